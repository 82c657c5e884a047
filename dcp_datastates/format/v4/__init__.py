"""Format version 4: a small index of sharding rules and listed chunks, and one metadata part
per rank (``index.py`` says how they fit together).

* ``index.py``: the index as decoded (``IndexTable``, a ``model.ChunkTable``) and its wire form;
* ``rules.py``: a DTensor's chunks as a sharding rule over a device mesh;
* ``chunk_lists.py``: the chunks of tensors without a rule, and the records of replicated boxes
  the index holds itself;
* ``rank_files.py``: the files named by rank (data files and parts), and a part's tail;
* ``planner_paths.py``: DCP's flattening paths as patterns.
"""
