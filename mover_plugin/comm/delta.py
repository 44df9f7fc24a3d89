"""Delta communicators: at a generation switch, only the groups that contain a changed rank
are rebuilt.

A newcomer takes the global rank of the process it replaces, so every group keeps its member
list; only a group that contains a replaced rank needs a new communicator. A process of the
new generation (a promoted standby) builds its groups the ordinary way —
``init_process_group`` and ``new_group`` (Megatron-Core's ``initialize_model_parallel``) on
the new generation's store. A process that stays builds, for each of its groups that contains a
replaced rank, a new group that meets the newcomer's in the same store keys (c10d's prefix
scheme, mirrored by :func:`rendezvous_store`), and registers it with c10d in the old group's
place under the same name: ``get_rank(group)``, ``get_global_rank``, point-to-point by global
rank and the functional collectives' name registry all see the new group. Every other group,
and its connections, is kept.

The default group holds every rank. Once it is covered by the job's other groups
(:mod:`mover_plugin.comm.world`) it has no connections to rebuild: it is kept, and its cover is
pointed at the replacements. Otherwise every rank rebuilds it. A rebuilt group connects each
member to its ring neighbours before it is installed and other pairs on first use (see
:class:`~mover_plugin.comm.process_group.MoverProcessGroup`), so what a staying member pays does
not grow with the group. In a planned migration all of this happens in phase 1, while training
goes on.

After a crash a kept group may have been left in the middle of an operation: the survivors
were pulled out of whatever they waited in. Such a group is reused only if it is idle on every
member (all operations issued there completed, which means all members issued the same ones);
:func:`agree_on_idle_groups` establishes that through the store, one round per group, and the
others are rebuilt like the groups of the lost rank.

Typical use at a stayer, generation ``g`` to ``g + 1`` with rank 3 replaced::

    delta = prepare_delta(store_of_generation(g + 1), changed={3}, timeout=timeout)
    ...                                   # (in the background during a planned migration)
    replaced = install_delta(delta)       # {id(old group): new group}, for rewiring references

This module uses c10d's private world maps of torch 2.13 and 2.14 (checked by :func:`check_c10d`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import PrefixStore, Store

from mover_plugin.comm.cancel import BuildCancelled, wait_for_keys
from mover_plugin.comm.errors import CommAborted
from mover_plugin.comm.process_group import BACKEND_NAME, MoverProcessGroup
from mover_plugin.comm.world import WorldGroup, group_members, group_name_order

logger = logging.getLogger(__name__)

_C10D_NAMES = ("_world", "_register_process_group", "_unregister_process_group",
               "_update_default_pg", "_get_default_group")
_DEVICE_PREFIX = "cpu/"
"""c10d hands a plugin backend's creator the store of the first device in the backend's
capability list; ``mover`` declares ``cpu`` first (see mover_plugin.comm.backend)."""


class DeltaError(CommAborted):
    """The groups of the next generation could not be prepared or installed."""


def check_c10d() -> None:
    """Raises :class:`DeltaError` if this torch lacks the c10d internals used here."""
    missing = [name for name in _C10D_NAMES if not hasattr(c10d, name)]
    if missing:
        raise DeltaError(f"torch {torch.__version__} lacks c10d's {', '.join(missing)}: the "
                         "delta communicators were written for torch 2.13 and 2.14")


@dataclass(frozen=True)
class GroupInfo:
    """One group this process is a member of, as c10d knows it."""

    name: str
    global_ranks: tuple[int, ...]
    is_default: bool
    covered: bool = False
    """Carried by a cover (:mod:`mover_plugin.comm.world`): no connections to rebuild."""


def replaced_group_names(groups: Sequence[GroupInfo], changed: Collection[int],
                         unsettled: Collection[str] = ()) -> list[str]:
    """The names of the groups to rebuild: those holding a changed rank (the default group
    holds them all), and the ``unsettled`` ones (not idle on every member); never a covered
    group, which has no connections of its own."""
    changed = set(changed)
    unsettled = set(unsettled)

    def holds_changed(group: GroupInfo) -> bool:
        return bool(changed) and (group.is_default or bool(changed & set(group.global_ranks)))

    return [g.name for g in groups
            if not g.covered and (g.name in unsettled or holds_changed(g))]


def member_groups() -> dict[str, tuple[Any, GroupInfo]]:
    """Every group this process is a member of (the default group included), by c10d name."""
    world = c10d._world
    default = c10d._get_default_group()
    groups = {}
    for group, name in world.pg_names.items():
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        groups[name] = (group, GroupInfo(name, group_members(group), group is default,
                                         is_covered(group)))
    return groups


def member_groups_in_order() -> list[tuple[Any, GroupInfo]]:
    """:func:`member_groups` in the order of their creation, the default group first (every
    process that built the same groups the same way lists them alike)."""
    groups = member_groups()
    ordered = sorted(groups.values(), key=lambda entry: (not entry[1].is_default,
                                                         group_name_order(entry[1].name)))
    return ordered


def pair_rebuilt_groups(old: Sequence[tuple[Any, GroupInfo]],
                        new: Sequence[tuple[Any, GroupInfo]]) -> dict[int, Any]:
    """``{id(old group): new group}`` for groups built again from scratch, the same way, in a
    new world (:func:`member_groups_in_order` then and now). Raises :class:`DeltaError` when
    the two lists do not hold the same members in the same order."""
    shapes = ([info.global_ranks for _, info in old], [info.global_ranks for _, info in new])
    if shapes[0] != shapes[1]:
        raise DeltaError(f"the groups built again differ from those before: {shapes[1]} "
                         f"instead of {shapes[0]}")
    return {id(before): after for (before, _), (after, _) in zip(old, new)}


def rendezvous_store(generation_store: Store, name: str, default_name: str) -> Store:
    """The store c10d gives a group named ``name``'s backend when the default group (named
    ``default_name``) was initialized on ``generation_store``: ``"{default}/"`` for the
    default group, ``"{default}/{name}/"`` for the others, then the device prefix."""
    store = PrefixStore(f"{default_name}/", generation_store)
    if name != default_name:
        store = PrefixStore(f"{name}/", store)
    return PrefixStore(_DEVICE_PREFIX, store)


@dataclass
class PreparedDelta:
    """Groups of the next generation built but not yet in use, and the old ones they replace."""

    replacements: dict[str, tuple[Any, MoverProcessGroup]] = field(default_factory=dict)
    """By c10d name: (the group in use, its replacement)."""
    kept: dict[str, Any] = field(default_factory=dict)
    """By c10d name: the groups that stay as they are."""
    build_s: float = 0.0


def prepare_delta(generation_store: Store, changed: Collection[int], *, timeout: timedelta,
                  unsettled: Collection[str] = ()) -> PreparedDelta:
    """Builds this process's replacement groups for the next generation (it blocks until the
    members of each group have built theirs). Nothing in use changes."""
    check_c10d()
    started = time.perf_counter()
    groups = member_groups()
    default_name = c10d._world.pg_names[c10d._get_default_group()]
    names = set(replaced_group_names([info for _, info in groups.values()], changed, unsettled))
    delta = PreparedDelta(kept={name: group for name, (group, _) in groups.items()
                                if name not in names})
    rank = dist.get_rank()
    foreign = sorted(name for name in names if not isinstance(groups[name][0], MoverProcessGroup))
    if foreign:
        raise DeltaError(f"groups {foreign} do not use the {BACKEND_NAME!r} backend; only its "
                         "groups can be replaced (create every group with it, e.g. Megatron's "
                         "initialize_model_parallel(create_gloo_process_groups=False))")
    by_members: dict[tuple[int, ...], MoverProcessGroup] = {}
    try:
        for name in sorted(names, key=group_name_order):
            old, info = groups[name]
            store = rendezvous_store(generation_store, name, default_name)
            options = old.nccl_options_copy()  # the members that keep theirs have these
            if info.is_default:
                new = WorldGroup(store, rank, len(info.global_ranks), timeout, group_name=name,
                                 nccl_options=options)
            else:
                # The first replacement with these members connects; the others share it,
                # as a newcomer's groups do (the mover backend: in creation = name order).
                members = tuple(info.global_ranks)
                new = MoverProcessGroup(store, info.global_ranks.index(rank), len(members),
                                        timeout, group_name=name, global_ranks=list(members),
                                        nccl_options=options,
                                        share_with=by_members.get(members))
                by_members.setdefault(members, new)
            delta.replacements[name] = (old, new)
    except BuildCancelled:
        discard_delta(delta)
        raise
    except Exception as error:
        discard_delta(delta)
        raise DeltaError(f"could not build the next generation's groups: {error}") from error
    delta.build_s = time.perf_counter() - started
    logger.debug("prepared %d replacement group(s) in %.3f s; keeping %d",
                 len(delta.replacements), delta.build_s, len(delta.kept))
    return delta


def discard_delta(delta: PreparedDelta) -> None:
    """Releases replacement groups that will not be installed."""
    for _, new in delta.replacements.values():
        new.shutdown()
    delta.replacements.clear()


def install_delta(delta: PreparedDelta) -> dict[int, Any]:
    """Puts each replacement in its old group's place in c10d and revives the kept groups;
    returns ``{id(old): new}`` for rewriting cached references
    (:func:`mover_plugin.runtime.rewire.rewire`). The old groups are shut down."""
    world = c10d._world
    replaced: dict[int, Any] = {}
    for name, (old, new) in delta.replacements.items():
        _register_in_place(world, name, old, new)
        replaced[id(old)] = new
        old.shutdown()
    for group in delta.kept.values():
        if isinstance(group, MoverProcessGroup):
            group.revive()
        if is_covered(group):
            group.replace_cover(replaced)
    return replaced


def is_covered(group: Any) -> bool:
    """Whether ``group`` is carried by a cover (never rebuilt in a delta)."""
    return isinstance(group, WorldGroup) and group.covered


def _register_in_place(world: Any, name: str, old: Any, new: MoverProcessGroup) -> None:
    _, store = world.pg_map[old]
    world.pg_map[new] = (BACKEND_NAME, store)
    world.pg_names[new] = name
    world.pg_group_ranks[new] = dict(world.pg_group_ranks[old])
    world.pg_backend_config[new] = world.pg_backend_config[old]
    tag = world.pg_to_tag.get(old)
    if tag is not None:
        world.pg_to_tag[new] = tag
    for members in world.tags_to_pg.values():
        for index, group in enumerate(members):
            if group is old:
                members[index] = new
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_to_tag, world.pg_coalesce_state):
        table.pop(old, None)
    c10d._unregister_process_group(name)
    c10d._register_process_group(name, new)
    if c10d._get_default_group() is old:
        c10d._update_default_pg(new)


def agree_on_idle_groups(store: Store, kept_candidates: Mapping[str, tuple[Any, GroupInfo]],
                         *, timeout: timedelta, drain_s: float = 0.1) -> list[str]:
    """After an alarm: which of these groups (none holds a lost rank) are *not* idle on every
    member. Each member waits up to ``drain_s`` for operations still completing, counts whether
    the group is idle on its side under ``store`` and reads the group's verdict, which the last
    member to answer writes: every member of a group reaches the same answer. The wait for the
    verdict ends with the cancel check (:mod:`mover_plugin.comm.cancel`)."""
    deadline = time.monotonic() + drain_s
    groups = {name: group for name, (group, _) in kept_candidates.items()}
    while time.monotonic() < deadline and not all(_is_idle(g) for g in groups.values()):
        time.sleep(0.005)
    return agree_on_idle(store, {name: (_is_idle(group), kept_candidates[name][1].global_ranks)
                                 for name, group in groups.items()}, timeout=timeout)


def agree_on_idle(store: Store, groups: Mapping[str, tuple[bool, Sequence[int]]], *,
                  timeout: timedelta) -> list[str]:
    """The store's part of :func:`agree_on_idle_groups` for one member: ``groups`` maps each
    group's name to whether it is idle here and its members' global ranks; returns the names
    of those some member found busy. Its two halves: :func:`post_idle`, :func:`read_idle`."""
    post_idle(store, groups)
    return read_idle(store, groups, timeout=timeout)


def post_idle(store: Store, groups: Mapping[str, tuple[bool, Sequence[int]]]) -> None:
    """Counts this member's answer about each of ``groups`` (busy or idle); the last member to
    answer writes the group's verdict. Each member makes a few store calls per group, however
    large the group (a data-parallel group of thousands of ranks included). Once per member and
    generation: the counts live in the generation's own namespace, never reused."""
    for name, (idle, members) in groups.items():
        store.add(f"idle/{name}/busy", 0 if idle else 1)
        if store.add(f"idle/{name}/answered", 1) == len(members):
            # Every member counted its answer before its arrival: the count is final.
            busy = store.add(f"idle/{name}/busy", 0)
            store.set(f"idle/{name}/verdict", "1" if busy == 0 else "0")


def read_idle(store: Store, groups: Mapping[str, tuple[bool, Sequence[int]]], *,
              timeout: timedelta) -> list[str]:
    """Waits for each of ``groups``' verdict; returns the names of those some member found
    busy."""
    unsettled = []
    for name in groups:
        key = f"idle/{name}/verdict"
        wait_for_keys(store, [key], timeout)
        if store.get(key) != b"1":
            unsettled.append(name)
    return unsettled


def _is_idle(group: Any) -> bool:
    return isinstance(group, MoverProcessGroup) and group.idle
