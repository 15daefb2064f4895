"""Renders a chat template with jinja2 the way Hugging Face transformers' `apply_chat_template`
does (trim_blocks, lstrip_blocks, a `tojson` without ASCII escaping), for fixed conversations
and template keyword arguments, as the fixture of the chat-template tests.

    ~/.venvs/dflash/bin/python tools/chat_template_reference/render.py \
        tests/fixtures/chat-templates/qwen3.jinja tests/fixtures/chat-templates/qwen3-expected.json
    ~/.venvs/dflash/bin/python tools/chat_template_reference/render.py \
        tests/fixtures/chat-templates/gemma3.jinja tests/fixtures/chat-templates/gemma3-expected.json "<bos>"
    ~/.venvs/dflash/bin/python tools/chat_template_reference/render.py \
        tests/fixtures/chat-templates/llama3.1.jinja tests/fixtures/chat-templates/llama3.1-expected.json \
        "<|begin_of_text|>"

The optional third argument is the template's `bos_token`.

Made with Jinja2 3.1.6.
"""
import json
import sys

from jinja2.sandbox import ImmutableSandboxedEnvironment

CASES = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "kwargs": {}},
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "kwargs": {"enable_thinking": True}},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "<think>\nTwo is prime.\n</think>\n\n2"},
            {"role": "user", "content": "Another?"},
        ],
        "kwargs": {"enable_thinking": False},
    },
]


def main() -> int:
    source, out = open(sys.argv[1]).read(), sys.argv[2]
    bos_token = sys.argv[3] if len(sys.argv) > 3 else ""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    template = env.from_string(source)
    results = []
    for case in CASES:
        text = template.render(messages=case["messages"], tools=case.get("tools"), add_generation_prompt=True,
                               bos_token=bos_token, **case["kwargs"])
        results.append({**case, "text": text})
    json.dump({"renderer": "jinja2 (transformers' settings)", "cases": results}, open(out, "w"), indent=1,
              ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
