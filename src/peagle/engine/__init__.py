"""The inference engine.

Host bookkeeping (sampling_params, sequence, block_manager, scheduler) is plain Python and imports no torch;
the device side (model runner, paged attention, sampler, speculation, LLM) is imported by name where needed.
This file stays free of imports so that `import peagle.engine.scheduler` remains torch-free.
"""
