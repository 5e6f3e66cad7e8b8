"""Benchmarks against torch SDPA and the demo (GPU and torch needed; importing stays CPU-cheap).

``python -m pyflashattn.bench prefill|prefill-features|batch|decode [options]`` (see ``__main__``),
``python -m pyflashattn.bench.demo``.
"""
