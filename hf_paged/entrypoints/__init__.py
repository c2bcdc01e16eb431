"""The front ends a user calls: ``LLM`` (``llm.py``), ``paged_generate_map`` for ``Dataset.map``
(``datasets_map.py``), Ray Data's ``map_generate`` (``ray.py``), torchrun / SLURM slices'
``shard_generate`` (``torchrun.py``), what the last two share (``rows.py``), and the ``hf-paged``
command (``cli/``). Each runs its prompts on the engine, through the one paged route of
``integration/`` where a call has ``generate``'s semantics. Import the modules themselves: this
package imports nothing (``import hf_paged`` stays light).
"""
