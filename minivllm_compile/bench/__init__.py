"""The measuring tools: `python -m minivllm_compile.bench` (__main__.py) runs the benchmarks, one
module each, on the helpers they share (common.py); startup.py and compare_modes.py measure one
start or one mode in a fresh process for notebooks 09 and 12. A measurement, never a test: every
comparison is a ratio of figures measured in the same run."""
