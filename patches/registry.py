"""The registry of framework patches: what a patch is, and how patches are applied and reverted.

A :class:`Patch` is a named, reversible change to a third-party framework (usually a
module-attribute replacement). Each patch states the distribution it targets, the range of
versions it was written and tested for, and a condition saying when it is wanted. Its ``apply``
function changes the framework and returns an undo function.

Patches are opt-in: registering a patch changes nothing. :func:`apply_patches` applies a group
or a list of patches all-or-nothing:

1. Names and groups are resolved, and every patch whose condition is false is skipped.
2. Every remaining patch is checked (not already applied, distribution installed, version inside
   the tested range) *before* anything is modified; the first failure raises.
3. The patches are applied in registration order. If one of them raises, the ones already applied
   are reverted before the error propagates.

Applying a patch that is already applied raises :class:`~mover_plugin.errors.PatchError`; revert
the earlier :class:`AppliedPatches` first. :meth:`AppliedPatches.revert` restores every replaced
attribute to the original object itself (``is``), and removes attributes that did not exist
before.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from types import TracebackType

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from mover_plugin.errors import PatchError, UnsupportedVersionError

logger = logging.getLogger(__name__)

Undo = Callable[[], None]
"""A function that reverts exactly what one ``apply`` call changed."""


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    """One reversible change to a framework.

    Attributes:
        name: unique name in its registry, e.g. ``"rng"``.
        distribution: the installed distribution it targets, e.g. ``"megatron-core"``.
        tested_versions: PEP 440 specifier of the versions it was written and tested for,
            e.g. ``">=0.19.0,<0.20"``.
        description: one line saying what the patch changes.
        apply: changes the framework and returns the :data:`Undo` for that change.
        condition: the patch is applied only when this returns True; otherwise it is skipped.
        groups: names of the groups the patch belongs to, e.g. ``("megatron-cpu",)``.
    """

    name: str
    distribution: str
    tested_versions: str
    description: str
    apply: Callable[[], Undo]
    condition: Callable[[], bool] = _always
    groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise PatchError("a patch needs a non-empty name")
        try:
            SpecifierSet(self.tested_versions)
        except InvalidSpecifier as exc:
            raise PatchError(
                f"patch {self.name!r}: invalid version range {self.tested_versions!r}"
            ) from exc

    def installed_version(self) -> str:
        """Return the installed version of :attr:`distribution`.

        Raises:
            PatchError: the distribution is not installed.
        """
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError as exc:
            raise PatchError(
                f"patch {self.name!r} targets the distribution {self.distribution!r}, "
                f"which is not installed"
            ) from exc

    def check_version(self) -> str:
        """Check that the installed version is inside :attr:`tested_versions`; return it.

        Pre-releases inside the range count as inside.

        Raises:
            PatchError: the distribution is not installed.
            UnsupportedVersionError: the installed version is outside the tested range.
        """
        found = self.installed_version()
        try:
            inside = SpecifierSet(self.tested_versions).contains(Version(found), prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            raise UnsupportedVersionError(
                f"patch {self.name!r} was written and tested for {self.distribution} "
                f"{self.tested_versions}, but {self.distribution} {found} is installed; "
                f"nothing was patched"
            )
        return found


class AttributeSwap:
    """Replaces attributes and mapping entries, and puts the originals back.

    Originals are read from the owner's own ``__dict__`` (or the mapping), so restoring gives back
    the very same object, and an attribute that was only inherited, or an entry that was absent,
    is deleted again rather than shadowed.
    """

    _ABSENT = object()

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, owner: object, name: str, value: object) -> None:
        """Set ``owner.name = value``, remembering what was there."""
        own = vars(owner)
        original = own[name] if name in own else self._ABSENT
        setattr(owner, name, value)
        self._undo.append(lambda: self._put_attr_back(owner, name, original))

    def set_item(self, mapping: MutableMapping[str, object], key: str, value: object) -> None:
        """Set ``mapping[key] = value``, remembering what was there."""
        original = mapping.get(key, self._ABSENT)
        mapping[key] = value
        self._undo.append(lambda: self._put_item_back(mapping, key, original))

    def restore(self) -> None:
        """Undo every change, last first. Calling it again does nothing."""
        while self._undo:
            self._undo.pop()()

    def _put_attr_back(self, owner: object, name: str, original: object) -> None:
        if original is self._ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)

    def _put_item_back(
        self, mapping: MutableMapping[str, object], key: str, original: object
    ) -> None:
        if original is self._ABSENT:
            mapping.pop(key, None)
        else:
            mapping[key] = original


class AppliedPatches:
    """The patches applied by one :func:`apply_patches` call.

    Use :meth:`revert`, or use the object as a context manager, which reverts on exit.
    """

    def __init__(
        self,
        registry: PatchRegistry,
        applied: list[tuple[Patch, Undo]],
        skipped: tuple[str, ...],
    ) -> None:
        self._registry = registry
        self._applied = applied
        self._skipped = skipped
        self._names = tuple(patch.name for patch, _ in applied)

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the patches that were applied, in the order they were applied."""
        return self._names

    @property
    def skipped(self) -> tuple[str, ...]:
        """Names of the requested patches that were skipped because their condition was false."""
        return self._skipped

    @property
    def active(self) -> bool:
        """True while at least one of these patches is applied, i.e. until :meth:`revert`."""
        return bool(self._applied)

    def revert(self) -> None:
        """Undo the patches, last applied first. Calling it again does nothing.

        Raises:
            PatchError: an undo function raised; every other undo still ran.
        """
        failures: list[str] = []
        with self._registry._lock:
            while self._applied:
                patch, undo = self._applied.pop()
                try:
                    undo()
                except Exception as exc:  # keep reverting the others
                    logger.exception("reverting patch %r failed", patch.name)
                    failures.append(f"{patch.name}: {exc!r}")
                finally:
                    self._registry._active.pop(patch.name, None)
        if failures:
            raise PatchError("reverting failed for " + "; ".join(failures))
        logger.debug("reverted patches %s", ", ".join(self._names))

    def __enter__(self) -> AppliedPatches:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "active" if self.active else "reverted"
        return f"AppliedPatches({list(self._names)!r}, {state})"


class PatchRegistry:
    """A set of named patches and the groups they belong to."""

    def __init__(self) -> None:
        self._patches: dict[str, Patch] = {}
        self._active: dict[str, AppliedPatches] = {}
        self._in_flight: list[str] = []
        """Patches applied so far by an :meth:`apply` still running (an ``apply`` function that
        imports a module can trigger a nested apply in the same thread)."""
        self._lock = threading.RLock()

    def register(self, patch: Patch) -> Patch:
        """Add ``patch``; return it.

        Raises:
            PatchError: a patch or group of the same name is already registered.
        """
        with self._lock:
            groups = self.groups()
            if patch.name in self._patches or patch.name in groups:
                raise PatchError(f"a patch or group named {patch.name!r} is already registered")
            clashing = [group for group in patch.groups if group in self._patches]
            if clashing or patch.name in patch.groups:
                raise PatchError(f"patch {patch.name!r}: group name clashes with a patch name")
            self._patches[patch.name] = patch
        return patch

    def get(self, name: str) -> Patch:
        """Return the patch called ``name``.

        Raises:
            PatchError: no such patch.
        """
        try:
            return self._patches[name]
        except KeyError:
            raise PatchError(
                f"unknown patch {name!r}; known patches: {sorted(self._patches)}"
            ) from None

    def available(self) -> tuple[Patch, ...]:
        """Every registered patch, in registration order."""
        return tuple(self._patches.values())

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Map each group name to the names of its patches, in registration order."""
        result: dict[str, tuple[str, ...]] = {}
        for patch in self._patches.values():
            for group in patch.groups:
                result[group] = result.get(group, ()) + (patch.name,)
        return result

    def active(self) -> tuple[str, ...]:
        """Names of the patches currently applied through this registry (those an ``apply``
        still running has applied so far included)."""
        with self._lock:
            return (*self._active, *(name for name in self._in_flight if name not in self._active))

    def resolve(self, group_or_names: str | Iterable[str]) -> tuple[Patch, ...]:
        """Turn a group name, a patch name, or an iterable of either into patches.

        Duplicates are dropped and the result follows registration order.

        Raises:
            PatchError: a name is neither a registered group nor a registered patch.
        """
        requested = [group_or_names] if isinstance(group_or_names, str) else list(group_or_names)
        groups = self.groups()
        wanted: set[str] = set()
        for name in requested:
            if name in groups:
                wanted.update(groups[name])
            elif name in self._patches:
                wanted.add(name)
            else:
                raise PatchError(
                    f"unknown patch or group {name!r}; groups: {sorted(groups)}, "
                    f"patches: {sorted(self._patches)}"
                )
        return tuple(patch for name, patch in self._patches.items() if name in wanted)

    def apply(self, group_or_names: str | Iterable[str]) -> AppliedPatches:
        """Apply patches all-or-nothing; see the module docstring for the steps.

        Raises:
            PatchError: unknown name, distribution not installed, patch already applied, or an
                ``apply`` function failed (after reverting the patches applied so far).
            UnsupportedVersionError: an installed version is outside a patch's tested range.
        """
        with self._lock:
            patches = self.resolve(group_or_names)
            wanted = {patch.name: patch.condition() for patch in patches}
            selected = [patch for patch in patches if wanted[patch.name]]
            skipped = tuple(name for name, ok in wanted.items() if not ok)
            for patch in selected:
                self._check_can_apply(patch)
            outer = len(self._in_flight)
            try:
                applied = self._apply_each(selected)
            finally:
                del self._in_flight[outer:]
            result = AppliedPatches(self, applied, skipped)
            for patch, _ in applied:
                self._active[patch.name] = result
        if skipped:
            logger.debug("skipped patches whose condition is false: %s", ", ".join(skipped))
        logger.info("applied patches: %s", ", ".join(result.names) or "(none)")
        return result

    def _check_can_apply(self, patch: Patch) -> None:
        if patch.name in self._active or patch.name in self._in_flight:
            raise PatchError(
                f"patch {patch.name!r} is already applied; revert it before applying it again"
            )
        patch.check_version()

    def _apply_each(self, patches: list[Patch]) -> list[tuple[Patch, Undo]]:
        applied: list[tuple[Patch, Undo]] = []
        for patch in patches:
            try:
                undo = patch.apply()
            except Exception as exc:
                self._roll_back(applied)
                raise PatchError(
                    f"applying patch {patch.name!r} failed; "
                    f"reverted {[done.name for done, _ in applied]}"
                ) from exc
            applied.append((patch, undo))
            self._in_flight.append(patch.name)
            logger.debug("applied patch %r: %s", patch.name, patch.description)
        return applied

    @staticmethod
    def _roll_back(applied: list[tuple[Patch, Undo]]) -> None:
        for patch, undo in reversed(applied):
            try:
                undo()
            except Exception:  # keep rolling back the others
                logger.exception("rolling back patch %r failed", patch.name)


DEFAULT_REGISTRY = PatchRegistry()
"""The registry that the plugin's own patches (e.g. the ``megatron-cpu`` group) belong to."""


def register_patch(patch: Patch) -> Patch:
    """Add ``patch`` to :data:`DEFAULT_REGISTRY`; return it."""
    return DEFAULT_REGISTRY.register(patch)


def apply_patches(group_or_names: str | Iterable[str]) -> AppliedPatches:
    """Apply a group or patches of :data:`DEFAULT_REGISTRY` all-or-nothing.

    ``group_or_names`` is a group name (``"megatron-cpu"``), a patch name, or an iterable of
    either. Patches whose condition is false are skipped and listed in
    :attr:`AppliedPatches.skipped`.

    Raises:
        PatchError: see :meth:`PatchRegistry.apply`.
        UnsupportedVersionError: an installed version is outside a patch's tested range.
    """
    return DEFAULT_REGISTRY.apply(group_or_names)


def apply_inactive_patches(group_or_names: str | Iterable[str]) -> AppliedPatches:
    """:func:`apply_patches` for those of the patches that are not applied already (by an
    earlier caller, e.g. the worker command before the script's own call)."""
    active = set(DEFAULT_REGISTRY.active())
    return DEFAULT_REGISTRY.apply([patch.name for patch in DEFAULT_REGISTRY.resolve(group_or_names)
                                   if patch.name not in active])


def available_patches() -> tuple[Patch, ...]:
    """Every patch of :data:`DEFAULT_REGISTRY`, in registration order."""
    return DEFAULT_REGISTRY.available()


def patch_groups() -> dict[str, tuple[str, ...]]:
    """Map each group of :data:`DEFAULT_REGISTRY` to the names of its patches."""
    return DEFAULT_REGISTRY.groups()


def active_patches() -> tuple[str, ...]:
    """Names of the patches of :data:`DEFAULT_REGISTRY` that are currently applied."""
    return DEFAULT_REGISTRY.active()
