"""``python -m pyflashattn.bench SUBCOMMAND [options]``: one entry for the benchmarks.

Each subcommand hands its remaining arguments to its module's own command line, so the flags
(``--quick``, ``--json PATH``, ...) and the output are those of the module.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, whether the module's parser takes the subcommand itself, summary)
SUBCOMMANDS = {
    "prefill": ("pyflashattn.bench.prefill", True,
                "single-request prefill vs torch SDPA (flash, cuDNN) and host overhead"),
    "prefill-features": ("pyflashattn.bench.prefill", True,
                         "cost of window / soft cap / ALiBi / RoPE / custom masks vs the plain prefill"),
    "batch": ("pyflashattn.bench.batch", False,
              "batch prefill wrappers (ragged, paged, fp8 paged), plan() and run() host times"),
    "decode": ("pyflashattn.bench.decode", False,
               "decode-like batches and single requests, KV bytes per second vs device copy"),
    "jax": ("pyflashattn.bench.jax_jit", False,
            "pyflashattn.jax inside jax.jit vs the eager call and jax.nn.dot_product_attention (cuDNN)"),
    "trtllm": ("pyflashattn.bench.trtllm", False,
               "TRT-LLM prefill APIs (contiguous / paged / context) vs SDPA cuDNN and FlashInfer's fmha_v2"),
}


def usage() -> str:
    lines = ["usage: python -m pyflashattn.bench {" + ",".join(SUBCOMMANDS) + "} [options]", "",
             "subcommands (each takes -h, --quick and --json PATH):"]
    lines += [f"  {name:<17} {summary}" for name, (_, _, summary) in SUBCOMMANDS.items()]
    lines += ["", "the demo: python -m pyflashattn.bench.demo (--arch: print this GPU's build arch)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"unknown subcommand {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, takes_name, _ = SUBCOMMANDS[cmd]
    return importlib.import_module(module).main([cmd] + rest if takes_name else rest)


if __name__ == "__main__":
    sys.exit(main())
