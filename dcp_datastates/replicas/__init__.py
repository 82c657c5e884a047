"""Peer replication of node-local checkpoints, in one package.

Below the save and load paths, above ``tiers/``: the replica group over gloo (``group``), the
transfers between nodes (``work`` for a save's replication, ``moves`` for the repair's), the
replicator that runs a rank's replications and repairs in one order (``replicator``), its
helper process (``helper``), the repair before a restore (``repair``), the records a rank keeps
(``records``) and the byte ranges a rank borrows (``borrowed``).  The adapters the layers above
use are named for their caller: ``for_writer`` (a ``DataStatesWriter``), ``for_load`` (a
``DataStatesReader(node_local=True)``) and ``for_run`` (``Checkpointer``)."""
