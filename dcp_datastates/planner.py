"""Planners: how DCP items map onto providers.

DCP's default planners work with ``DataStatesWriter``/``DataStatesReader``
unchanged.  These subclasses add what the format can use:

* :class:`DataStatesSavePlanner` orders each rank's items largest first, so
  the engine starts the long copies early and the small ones coalesce at the
  end of the data file;
* :class:`DataStatesLoadPlanner` receives non-tensor values already decoded
  from msgpack (``load_value``), without the ``torch.save``/``torch.load``
  round trip that DCP's ``load_bytes`` interface needs.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan


class DataStatesSavePlanner(DefaultSavePlanner):
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()

        def size(item) -> int:
            s = item.tensor_storage_size()
            return -(s or 0)

        return dataclasses.replace(plan, items=sorted(plan.items, key=size))


class DataStatesLoadPlanner(DefaultLoadPlanner):
    def load_value(self, read_item, value) -> None:
        """Set a decoded non-tensor value (the reader calls this instead of ``load_bytes``)."""
        from torch.distributed.checkpoint._traverse import set_element as _set
        if self.flatten_state_dict:
            _set(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value
