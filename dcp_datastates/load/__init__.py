"""The load path: DCP's ``StorageReader`` adapter (``reader``); what to read (``ranges``,
``tasks``), where from and how it is checked (``files``), one pass of a rank's reads
(``reads``), the reads shared between ranks (``cooperative``) and what DCP is told of a
manifest (``metadata``)."""
