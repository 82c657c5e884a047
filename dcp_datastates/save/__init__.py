"""The save path: DCP's ``StorageWriter`` adapter (``writer``), one save on one rank
(``rank_save``), how a save begins and what DCP's checkpoint process receives (``staging``), a
save's progress and the optimizer's step barrier (``progress``), the placement of its items
in the rank's files (``placement``), the writer's options (``options``) and ``async_save`` with
its guard (``guard``)."""
