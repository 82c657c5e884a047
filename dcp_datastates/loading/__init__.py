"""The read path beneath ``DataStatesReader``: what to read (``ranges``, ``tasks``), where from
and how it is checked (``files``), and what DCP is told of a manifest (``metadata``)."""
