// Teacher-forced log-probs from a llama.cpp build, for comparing builds with the reference
// files in tests/fixtures/llamacpp-greedy (docs/performance.md, "Parity with llama.cpp").
//
// Prompt as one batch, then the reference tokens one at a time, as the greedy run that made
// the reference; prints "step argmax lp(argmax) ref_token lp(ref_token)" per step.
// Optionally dumps named f32 graph tensors (e.g. kqv_out-0) to a file for layer-level checks.
//
// llama.cpp is not part of this repository: build it yourself, then (with LLAMA = its checkout,
// BUILD = its build directory)
//   g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include teacher_forced.cpp \
//       -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o teacher_forced
//   ./teacher_forced MODEL.gguf THREADS FLASH_ATTN(0|1) "prompt" "id,id,..." [DUMP_FILE name,name,...]
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <cstdlib>

static std::vector<std::string> g_names;
static FILE * g_dump = nullptr;
static int g_step = 0;

static bool cb(struct ggml_tensor * t, bool ask, void *) {
    bool want = false;
    for (auto & n : g_names) if (n == t->name) want = true;
    if (ask) return want;
    if (!want || !g_dump) return true;
    std::vector<float> buf(ggml_nelements(t));
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, buf.data(), 0, buf.size()*4);
    } else { fprintf(stderr, "skip %s type %d\n", t->name, t->type); return true; }
    int nl = strlen(t->name);
    fwrite(&g_step, 4, 1, g_dump); fwrite(&nl, 4, 1, g_dump); fwrite(t->name, 1, nl, g_dump);
    int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]}; fwrite(ne, 8, 4, g_dump);
    fwrite(buf.data(), 4, buf.size(), g_dump);
    return true;
}

int main(int argc, char ** argv) {
    // tf MODEL THREADS FA "prompt" "id,id,..." [dumpfile name,name,...]
    std::string model_path = argv[1]; int threads = atoi(argv[2]); int fa = atoi(argv[3]);
    std::string prompt = argv[4]; std::string ids = argv[5];
    if (argc > 7) { g_dump = fopen(argv[6], "wb"); std::string s = argv[7]; size_t p=0; while ((p = s.find(',')) != std::string::npos) { g_names.push_back(s.substr(0,p)); s.erase(0,p+1);} g_names.push_back(s); }
    std::vector<int> ref; { std::string s = ids; size_t p; while ((p = s.find(',')) != std::string::npos) { ref.push_back(atoi(s.substr(0,p).c_str())); s.erase(0,p+1);} if(!s.empty()) ref.push_back(atoi(s.c_str())); }
    llama_backend_init();
    auto mp = llama_model_default_params(); mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    int n = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> toks(n);
    llama_tokenize(vocab, prompt.c_str(), prompt.size(), toks.data(), n, true, true);
    fprintf(stderr, "prompt tokens %d\n", n);
    auto cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_threads = threads; cp.n_threads_batch = threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    int nv = llama_vocab_n_tokens(vocab);
    int pos = 0;
    std::vector<llama_token> cur = toks;
    for (size_t step = 0; step < ref.size(); ++step) {
        g_step = step;
        llama_batch_ext_clear(batch);
        for (size_t i = 0; i < cur.size(); ++i) { int idx = llama_batch_ext_add_token(batch, 0, cur[i]); llama_pos p = pos + i; llama_batch_ext_set_pos(batch, idx, &p); }
        llama_batch_ext_set_output_logits(batch, cur.size() - 1, true);
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) { fprintf(stderr, "fail\n"); return 1; }
        pos += cur.size();
        float * lg = llama_get_logits_ith(ctx, -1);
        double mx = -1e30; int am = 0; for (int i = 0; i < nv; ++i) if (lg[i] > mx) { mx = lg[i]; am = i; }
        double se = 0; for (int i = 0; i < nv; ++i) se += exp((double)lg[i] - mx);
        double lse = mx + log(se);
        printf("%zu %d %.4f %d %.4f\n", step, am, lg[am] - lse, ref[step], lg[ref[step]] - lse);
        cur = { ref[step] };
    }
    if (g_dump) fclose(g_dump);
    return 0;
}
