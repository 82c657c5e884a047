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

from torch.distributed.checkpoint._traverse import set_element
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
        _set_in_state_dict(self, read_item.dest_index.fqn, value)


def _set_in_state_dict(planner: DefaultLoadPlanner, fqn: str, value) -> None:
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def deliver_object(planner, read_item, value) -> bool:
    """Put ``value`` (a decoded value, or an object a provider rebuilt) into the state dict
    being loaded, in place of what is there.  True when done: our planner, or DCP's default
    planner (its state dict and key mappings); False for another planner, which then gets
    ``load_bytes`` (a tensor entry of such a planner keeps the bytes copied into it)."""
    if hasattr(planner, "load_value"):
        planner.load_value(read_item, value)
        return True
    if isinstance(planner, DefaultLoadPlanner):
        _set_in_state_dict(planner, read_item.dest_index.fqn, value)
        return True
    return False
