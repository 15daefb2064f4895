"""llama.cpp's server (llama-server's code, through the xllamacpp package) on MODEL at PORT,
with 2 threads and a 4096-token context, until killed: the comparison for run.sh.

Usage: python llama_server.py MODEL.gguf PORT   (in a venv with xllamacpp==2026.10.11549)
"""

import sys
import time

import xllamacpp

params = xllamacpp.CommonParams()
params.model.path = sys.argv[1]
params.port = int(sys.argv[2])
params.cpuparams.n_threads = 2
params.n_ctx = 4096
server = xllamacpp.Server(params)
print("listening", server.listening_address, flush=True)
while True:
    time.sleep(60)
