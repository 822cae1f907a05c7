"""`ember demo` and everything only it needs: its stages, its sample corpora and the reference sampler.

Apart from the library on purpose: nothing under `ember/` below this package imports it.
"""
