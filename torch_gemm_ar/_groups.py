"""Resolving a `group=` argument (the ops' wrappers, the nn layers, the converters, tuning): the group object, its
c10d name, its size and this rank's place, with the same errors everywhere, naming the caller."""
from dataclasses import dataclass
from typing import Union

import torch.distributed as dist

GroupLike = Union[None, str, dist.ProcessGroup]


@dataclass(frozen=True)
class GroupInfo:
    group: dist.ProcessGroup
    name: str
    world: int
    rank: int  # this process's rank inside `group`


def _group_object(group: GroupLike, who: str):
    """`group` as a ProcessGroup or a name (None: the default group), with the errors every caller shares. Traced by
    torch.compile in the ops' wrappers: only the checks dynamo follows (isinstance against one class)."""
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group() first"
            )
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() hands to ranks outside the group
            raise ValueError(
                f"{who}: this process (global rank {dist.get_rank()}) is not a member of the group it was given; "
                "pass the tensor-parallel group this rank belongs to"
            )
        raise TypeError(f"{who}: group must be a ProcessGroup, a group name or None; got {type(group).__name__}")
    return group


def resolve_group(group: GroupLike, who: str) -> GroupInfo:
    """GroupInfo of `group` (None: the default group, a str: a c10d group name); `who` prefixes the errors."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group() first"
        )
    group = _group_object(group, who)
    if isinstance(group, str):
        try:
            group = dist.distributed_c10d._resolve_process_group(group)
        except Exception as exc:  # c10d raises a bare RuntimeError for unknown names
            raise ValueError(f"{who}: no process group is named {group!r}") from exc
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of group "
            f"{group.group_name!r}; pass the tensor-parallel group this rank belongs to"
        )
    return GroupInfo(group=group, name=group.group_name, world=dist.get_world_size(group), rank=rank)


def group_name_of(group: GroupLike, who: str = "gemm_allreduce") -> str:
    """The c10d group name of `group` (None: the default group), as the torch.ops.pto ops take it: cheap enough for
    every call (no membership query). A name is passed through as it is: the op itself raises, naming the op, when no
    group has it."""
    group = _group_object(group, who)
    return group if isinstance(group, str) else group.group_name
