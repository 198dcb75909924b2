"""A model repository: ``REPO/<model>/<version>/`` artifacts, a version policy, and zero-downtime reloads.

A new version is loaded (checksums verified by ``load``), put behind batchers of its own and warmed up
off the serving path; only then is it swapped in, in one step of the event loop. Calls already holding
the old version (a lease, or a request in its batchers) finish on it; then its batchers stop, and when the
last call holding it returns its runtime is freed by reference count, which unmaps its weight files. A
version that fails to load or warm up is logged with its error's type, counted in the metrics, reported in
the model's metadata and the repository index, and never replaces a good one. Before loading, the free
memory must hold the new version beside the ones already loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from infer import request_rules as rules
from infer.artifact.load import load
from infer.artifact.manifest import MANIFEST_FILE, Manifest, artifact_files
from infer.artifact.runtime import PhaseClock
from infer.artifact.structures import StructureCache
from infer.errors import ArtifactError, ConfigError, EmbserveError
from infer.features import SparseFeatures
from server.adapters.oip.core import ModelNotFound, ServedModel
from server.adapters.v1 import codec
from server.adapters.v1.service import InferenceServicer
from server.batcher import MAX_MERGE_EXAMPLES, DynamicBatcher
from server.metrics import ServerMetrics
from server.pipeline import Failure, run_lookup, run_predict

logger = logging.getLogger(__name__)


class LoadError(EmbserveError):
    """A model version could not be loaded, verified or warmed up (the good versions keep serving)."""


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of each model to serve: the ``latest`` N, or an explicit list of ``versions``."""

    latest: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.latest < 1 and not self.versions:
            raise ConfigError(f"version policy latest={self.latest}: serve at least the latest 1 version")
        if any(v < 1 for v in self.versions):
            raise ConfigError(f"version policy versions={list(self.versions)}: versions are positive integers")

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """``latest:N`` or ``versions:1,3`` (the command line's ``--version-policy``)."""
        kind, _, value = text.partition(":")
        try:
            if kind == "latest":
                return cls(latest=int(value or "1"))
            if kind == "versions":
                return cls(versions=tuple(int(v) for v in value.split(",") if v.strip()))
        except ValueError:
            pass
        raise ConfigError(f"version policy {text!r}: write 'latest:N' or 'versions:1,3'")

    def select(self, available: Sequence[int]) -> list[int]:
        if self.versions:
            return sorted(v for v in available if v in self.versions)
        return sorted(available)[-self.latest :]


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int
    max_delay_s: float
    max_queue: int
    workers: int
    warmup_batches: int = 3
    threads: int = 0  # threads each CPU kernel splits a batch over; 0: the runtime's budget for ``workers``
    max_merge_examples: int = MAX_MERGE_EXAMPLES  # requests merge into one forward up to this many examples
    verify: str = "full"  # checksums at each version's load (infer.load's verify)


def is_repository(path: Any) -> bool:
    """A folder of model folders (no manifest of its own), as opposed to one artifact."""
    folder = Path(path) if isinstance(path, (str, os.PathLike)) else None
    return (
        folder is not None
        and folder.is_dir()
        and not (folder / MANIFEST_FILE).exists()
        and not artifact_files(folder)  # an artifact that lost its manifest: load names what is missing
    )


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def artifact_bytes(folder: Path) -> int:
    """The memory a version needs beside the loaded ones: its files, except mapped weight files (format 3),
    which live in the page cache, shared between versions and processes and evictable, never in the process's
    own memory."""
    try:
        manifest = Manifest.read(folder)
        mapped = {k.weights.file for k in manifest.kernels if k.weights is not None}
    except EmbserveError:  # the load that follows names what is wrong
        mapped = set()
    return sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in mapped
    )


def describe_failure(err: BaseException) -> str:
    """Why a version failed to load, typed: the message, then the error's class (and kind, for an artifact
    error), as the log, the model's metadata and the repository index report it."""
    if isinstance(err, ArtifactError):
        return f"{err} [ArtifactError(kind={err.kind.value})]"
    if isinstance(err, EmbserveError):
        return f"{err} [{type(err).__name__}]"
    return f"{type(err).__name__}: {err}"


def _signature(folder: Path) -> tuple[int, int]:
    """Changes when the version's folder is rewritten (a failed version is retried once it changes)."""
    manifest = folder / MANIFEST_FILE
    try:
        stat = manifest.stat()
    except OSError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)


@dataclass
class _Loaded:
    model: ServedModel
    batchers: list[DynamicBatcher]
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    v1_view: InferenceServicer | None = None  # embserve.v1 calls that name this version run on it
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each phase of its load and warm-up

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()


class _CountedBatcher:
    """A version's batcher as the embserve.v1 servicer sees it: its submits count as calls in flight."""

    def __init__(self, loaded: _Loaded, batcher: DynamicBatcher) -> None:
        self._loaded = loaded
        self._batcher = batcher

    @property
    def depth(self) -> int:
        return self._batcher.depth

    async def submit(self, features: SparseFeatures, dense: torch.Tensor | None = None) -> torch.Tensor:
        self._loaded.enter()
        try:
            return await self._batcher.submit(features, dense)
        finally:
            self._loaded.leave()

    async def run_now(self, features: SparseFeatures, dense: torch.Tensor | None = None) -> torch.Tensor:
        self._loaded.enter()
        try:
            return await self._batcher.run_now(features, dense)
        finally:
            self._loaded.leave()

    def start(self) -> None:  # the repository starts and stops its versions' batchers
        pass

    async def close(self) -> None:
        pass


class Repository:
    """The models of a repository folder, each with the versions its policy selects (a ``ModelSet``)."""

    def __init__(
        self,
        root: str | Path,
        settings: BatchSettings,
        metrics: ServerMetrics,
        policy: VersionPolicy = VersionPolicy(),
        check_memory: bool = True,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} is not a folder; give REPO with REPO/<model>/<version>/")
        self.settings = settings
        self.metrics = metrics
        self.policy = policy
        self.check_memory = check_memory
        self._models: dict[str, dict[str, _Loaded]] = {}
        self._failed: dict[tuple[str, str], tuple[tuple[int, int], str]] = {}
        self._lock = asyncio.Lock()
        self._poll_task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self._v1: InferenceServicer | None = None
        self._v1_model: str | None = None
        # versions of one layout share their model's structure: a swap copies it instead of compiling it again
        # while holding the GIL (infer.artifact.structures)
        self.structures = StructureCache()

    # ---------------------------------------------------------------------------------- ModelSet
    def _versions_of(self, name: str) -> dict[str, _Loaded]:
        versions = self._models.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model {name!r}; this server serves {sorted(self._models)}")
        return versions

    def _entry(self, name: str, version: str) -> _Loaded:
        versions = self._versions_of(name)
        if not version:
            return versions[max(versions, key=int)]
        if version not in versions:
            failure = self._failed.get((name, version))
            reason = f" (it failed to load: {failure[1]})" if failure else ""
            raise ModelNotFound(
                f"model {name!r} has no version {version!r} loaded{reason}; its versions are {self.versions(name)}"
            )
        return versions[version]

    def find(self, name: str, version: str) -> ServedModel:
        return self._entry(name, version).model

    @contextlib.asynccontextmanager
    async def lease(self, name: str, version: str) -> AsyncIterator[ServedModel]:
        entry = self._entry(name, version)
        entry.enter()
        try:
            yield entry.model
        finally:
            entry.leave()

    def versions(self, name: str) -> list[str]:
        return sorted(self._versions_of(name), key=int)

    def served(self) -> list[ServedModel]:
        return [versions[v].model for _, versions in sorted(self._models.items()) for v in sorted(versions, key=int)]

    def ready(self, name: str, version: str) -> bool:
        try:
            self._entry(name, version)
        except ModelNotFound:
            return False
        return True

    def load_phases(self, name: str, version: str) -> dict[str, float]:
        """Seconds of each phase of bringing a loaded version in (load, batchers, warm-up), as its log line says."""
        return dict(self._entry(name, version).phases)

    def failures(self, name: str) -> dict[str, str]:
        """version -> why it failed to load, for the versions of ``name`` that did."""
        return {v: why for (m, v), (_, why) in self._failed.items() if m == name}

    async def load(self, name: str) -> None:
        """Bring ``name`` in line with its folder: load the versions the policy selects, retire the rest."""
        if not name or "/" in name or name.startswith("."):
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"model name {name!r} is not a folder name", "invalid")
        if not (self.root / name).is_dir():
            raise ModelNotFound(f"the repository {self.root} has no model folder {name!r}")
        async with self._lock:
            await self._sync(name, explicit=True)

    async def unload(self, name: str) -> None:
        """Retire every version of ``name`` (calls on them finish first). embserve.v1's default model moves
        to the first other loaded model; the last model loaded cannot be unloaded."""
        async with self._lock:
            versions = self._versions_of(name)
            others = [m for m in sorted(self._models) if m != name]
            if not others:
                raise Failure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {name!r} is the only model this server serves; load another model before unloading it",
                    "last_model",
                )
            del self._models[name]
            if self._v1_model == name:
                self._v1_model = others[0]
                self._point_v1(others[0])
                logger.info("embserve.v1 now serves model %s by default (%s was unloaded)", others[0], name)
            for entry in versions.values():
                self._retire(entry)
            logger.info("unloaded model %s (versions %s)", name, sorted(versions, key=int))

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        """The repository extension's index: each loaded version READY; with ``ready_only`` False also each
        version that failed to load and each model folder with nothing loaded (UNAVAILABLE, with why)."""
        entries = []
        for name in sorted(set(self.model_names()) | set(self._models)):
            loaded = self._models.get(name, {})
            entries += [_index_entry(name, version, "READY", "") for version in sorted(loaded, key=int)]
            if ready_only:
                continue
            failed = sorted((int(v), why) for (m, v), (_, why) in self._failed.items() if m == name and v not in loaded)
            entries += [_index_entry(name, str(v), "UNAVAILABLE", self._for_client(why)) for v, why in failed]
            if not loaded and not failed:
                entries.append(_index_entry(name, "", "UNAVAILABLE", "not loaded (load it with RepositoryModelLoad)"))
        return entries

    def _for_client(self, message: str) -> str:
        """A message as a client sees it: paths inside the repository, not the server's file system."""
        return message.replace(f"{self.root}{os.sep}", "")

    # ---------------------------------------------------------------------------------- loading
    def model_names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def _available_versions(self, name: str) -> list[int]:
        folder = self.root / name
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)

    async def load_all(self) -> None:
        """Load every model of the repository (at start); fails when no version of any model loads."""
        async with self._lock:
            for name in self.model_names():
                await self._sync(name, explicit=False)
        if not self._models:
            failures = "; ".join(f"{m}/{v}: {why}" for (m, v), (_, why) in self._failed.items())
            names = self.model_names()
            raise ConfigError(
                f"model repository {self.root} has no loadable model: looked for "
                f"{self.root / '<model>' / '<version>' / MANIFEST_FILE} (model folders: "
                + (rules.clip_names(names) if names else "none")
                + ") and found "
                + (f"none that loads; failures: {failures}" if failures else "no version folder")
                + f"; {self.root / MANIFEST_FILE} is missing too, so it is not one artifact either"
            )

    async def poll_once(self) -> None:
        async with self._lock:
            for name in self.model_names():
                await self._sync(name, explicit=False)

    def start_polling(self, interval_s: float) -> None:
        async def poll() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.poll_once()
                except Exception:  # noqa: BLE001 - a poll that fails must not stop the next one
                    logger.exception("repository poll failed")

        self._poll_task = asyncio.create_task(poll())

    async def _sync(self, name: str, explicit: bool) -> None:
        wanted = [str(v) for v in self.policy.select(self._available_versions(name))]
        if explicit and not wanted:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model {name!r} has no version the policy {self.policy} selects; add {name}/<version>/ folders",
                "load_failed",
            )
        loaded = self._models.get(name, {})
        errors = []
        for version in wanted:
            if version in loaded:
                continue
            signature = _signature(self.root / name / version)
            failed = self._failed.get((name, version))
            if failed is not None and failed[0] == signature and not explicit:
                continue  # already reported; retried once the folder changes (or on an explicit load)
            try:
                entry = await self._load_version(name, version)
            except Exception as err:  # noqa: BLE001 - any failure of a new version leaves the good ones serving
                message = describe_failure(err)
                self._failed[(name, version)] = (signature, message)
                self.metrics.requests.labels("model load", "FAILED").inc()
                logger.error("model %s version %s failed to load; the loaded versions keep serving: %s",
                             name, version, message)  # fmt: skip
                errors.append(f"version {version}: {message}")
                continue
            self._failed.pop((name, version), None)
            versions = dict(self._models.get(name, {}))
            versions[version] = entry
            self._models[name] = versions  # the swap: one assignment, between two steps of the loop
            self._point_v1(name)
            self.metrics.requests.labels("model load", "OK").inc()
            logger.info("model %s version %s is serving", name, version)
        if not self._models.get(name) and not self.policy.versions:
            # nothing of this model serves (the newest versions failed at start): fall back to older ones
            for older in reversed(self._available_versions(name)):
                if str(older) in wanted or (name, str(older)) in self._failed:
                    continue
                try:
                    entry = await self._load_version(name, str(older))
                except Exception as err:  # noqa: BLE001 - as above: reported, and the next older one is tried
                    self._failed[(name, str(older))] = (
                        _signature(self.root / name / str(older)),
                        describe_failure(err),
                    )
                    continue
                self._models[name] = {str(older): entry}
                self._point_v1(name)
                logger.warning("model %s serves version %s: the newer versions failed to load", name, older)
                break
        serving = self._models.get(name, {})
        # versions the policy no longer selects go once a selected one serves (never leave a model empty)
        stale = [v for v in serving if v not in wanted] if any(v in serving for v in wanted) else []
        for version in stale:
            versions = dict(self._models[name])
            entry = versions.pop(version)
            self._models[name] = versions
            self._point_v1(name)
            self._retire(entry)
            logger.info("model %s version %s retired (policy %s)", name, version, self.policy)
        if explicit and errors:
            message = self._for_client(f"model {name!r}: " + "; ".join(errors))
            raise Failure(grpc.StatusCode.FAILED_PRECONDITION, message, "load_failed")

    async def _load_version(self, name: str, version: str) -> _Loaded:
        folder = self.root / name / version
        clock = PhaseClock()
        if self.check_memory:
            needed = artifact_bytes(folder)
            available = available_memory_bytes()
            if available is not None and needed > available:
                raise LoadError(
                    f"model {name!r} version {version} needs about {needed / 2**20:.0f} MiB ({folder}) but only "
                    f"{available / 2**20:.0f} MiB are free beside the loaded versions; free memory, unload a "
                    "version or narrow the version policy"
                )
            clock.mark("memory check")
        # a thread of its own: its lowered priority must not stay with a pool thread that serves later
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embserve-load")
        try:
            runtime = await asyncio.get_running_loop().run_in_executor(
                loader, _load_in_background, folder, self.settings.verify, self.structures
            )
        finally:
            loader.shutdown(wait=False)
        clock.mark("load")
        settings = self.settings
        runtime.set_threads(settings.threads or runtime.thread_budget(settings.workers))
        # the version's forwards, as for one artifact: every request was decoded and validated once against this
        # version's own spec before it was queued
        lookup, predict = functools.partial(run_lookup, runtime), functools.partial(run_predict, runtime)

        def batcher(run: Callable[..., torch.Tensor]) -> DynamicBatcher:
            return DynamicBatcher(
                run,
                settings.max_batch_size,
                settings.max_delay_s,
                settings.max_queue,
                settings.workers,
                self.metrics.observe_batch,
                settings.max_merge_examples,
            )

        lookups = batcher(lookup)
        predictions = batcher(predict) if runtime.has_dense else None
        model = ServedModel(name, version, runtime, lookups, predictions, None, settings.max_batch_size)
        if predictions is not None:
            model.both = batcher(model.run_both)
            model.count_executions(model.both)
        batchers = [b for b in (lookups, predictions, model.both) if b is not None]
        entry = _Loaded(model, batchers)
        for b in batchers:
            b.start()
        clock.mark("batchers")
        try:
            await _warm_up(model, settings.warmup_batches, clock)
        except BaseException:
            for b in batchers:
                await b.close()
            raise
        phases = entry.phases = _load_phases(clock.seconds, runtime.load_phases)
        self.metrics.observe_load(phases)
        logger.info("model %s version %s ready in %.3f s (verify %s); seconds by phase: %s", name, version, clock.total,
                    settings.verify, ", ".join(f"{p} {s:.3f}" for p, s in phases.items()))  # fmt: skip
        return entry

    def _retire(self, entry: _Loaded) -> None:
        """Once the calls on ``entry`` are done, stop its batchers and let its memory go."""

        async def retire() -> None:
            entry.v1_view = None  # no new v1 call finds it; the ones holding it count as in flight
            for b in entry.batchers:
                b.flush()  # the calls left on it need not wait for company that will not come
            await entry.idle.wait()
            for b in entry.batchers:
                await b.close()
            entry.batchers.clear()
            logger.info("model %s version %s freed", entry.model.name, entry.model.version)
            # the version's runtime (and with it the mapping of its weight files) goes by reference count when the
            # last call holding it returns: no collection pass on the loop; run_both is the one cycle to break
            entry.model.both = None
            del entry.model

        task = asyncio.create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def retired(self) -> None:
        """Return once every retired version has been freed (tests, shutdown)."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    # ---------------------------------------------------------------------------------- embserve.v1
    def default_runtime(self) -> Any:
        name = self.model_names_loaded()[0]
        return self._entry(name, "").model.runtime

    def model_names_loaded(self) -> list[str]:
        return sorted(self._models)

    def attach_v1(self, servicer: InferenceServicer) -> None:
        """Let the embserve.v1 service serve the first model's newest version, and follow its reloads."""
        self._v1 = servicer
        self._v1_model = self.model_names_loaded()[0]
        self._point_v1(self._v1_model)

    def v1_for(self, name: str, version: str) -> InferenceServicer:
        """The embserve.v1 servicer of one model version (for v1 calls that name a model or version)."""
        entry = self._entry(name or (self._v1_model or ""), version)
        if entry.v1_view is None:
            assert self._v1 is not None
            entry.v1_view = copy.copy(self._v1)  # shares metrics and settings; gets this version's model
            _bind_v1(entry.v1_view, entry)
        return entry.v1_view

    def _point_v1(self, name: str) -> None:
        if self._v1 is not None and name == self._v1_model:
            entry = self._entry(name, "")
            self._v1.pipeline.follow(entry.model.runtime)
            _bind_v1(self._v1, entry)

    def flush(self) -> None:
        """The server's drain began: every version's batches run now instead of waiting for company."""
        for versions in self._models.values():
            for entry in versions.values():
                for b in entry.batchers:
                    b.flush()

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
            self._poll_task = None
        async with self._lock:
            models, self._models = self._models, {}
            for versions in models.values():
                for entry in versions.values():
                    self._retire(entry)
        await self.retired()


def _index_entry(name: str, version: str, state: str, reason: str) -> dict[str, str]:
    return {"name": name, "version": version, "state": state, "reason": reason}


def _load_in_background(folder: Path, verify: str = "full", structures: StructureCache | None = None) -> Any:
    """``load`` at the lowest CPU priority (this thread only, on Linux): the versions serving meanwhile
    keep the cores they need, and the new version takes longer to arrive instead."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: load at normal priority
        pass
    try:
        return load(folder, verify=verify, structures=structures)
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
        except (AttributeError, OSError):  # lowering back may need privileges; the thread then stays nice
            pass


def _bind_v1(servicer: InferenceServicer, entry: _Loaded) -> None:
    """Point an embserve.v1 servicer at one version, all in one step of the loop: a v1 call then decodes
    against this spec and queues on these batchers (its submits count as calls in flight on the version)."""
    model = entry.model
    servicer.runtime = model.runtime
    servicer.spec = model.spec
    servicer.version = model.sha256[:16]
    servicer.lookups = _CountedBatcher(entry, model.lookups)  # type: ignore[assignment]
    counted = _CountedBatcher(entry, model.predictions) if model.predictions is not None else None
    servicer.predictions = counted  # type: ignore[assignment]
    servicer._columns = codec.column_ranges(model.spec)
    servicer._metadata = servicer._build_metadata()


def _load_phases(seconds: dict[str, float], load_phases: dict[str, float]) -> dict[str, float]:
    """The phases of bringing a version in, in order, with the load's own phases in place of the load: what the
    loader thread spent beyond them (starting, waiting for the event loop) is its ``hand-off``."""
    phases: dict[str, float] = {}
    for phase, spent in seconds.items():
        if phase == "load":
            phases.update(load_phases)
            phases["hand-off"] = max(0.0, spent - sum(load_phases.values()))
        else:
            phases[phase] = spent
    return phases


async def _warm_up(model: ServedModel, batches: int, clock: PhaseClock | None = None) -> None:
    """Run a few random batches through the new version's batchers (each kind of forward) before it serves; every
    answer must have the shape the model's spec promises, embeddings finite (else ``LoadError``: the version is
    refused). ``clock`` charges each kind of forward to a phase of its own."""
    spec = model.spec
    clock = clock or PhaseClock()
    for seed in range(max(1, batches)):
        features = SparseFeatures.random(spec, batch_size=min(64, model.max_batch_size), ids_per_bag=8, seed=seed)
        size = features.batch_size
        _check_warm_answer(model, "lookup", await model.lookups.run_now(features), (size, spec.output_dim))
        clock.mark("warm-up lookup")
        if model.predictions is not None and model.both is not None:
            dense = torch.zeros(size, spec.num_dense_features)
            _check_warm_answer(model, "predict", await model.predictions.run_now(features, dense), (size,))
            clock.mark("warm-up predict")
            both = await model.both.run_now(features, dense)
            _check_warm_answer(model, "lookup and predict", both, (size, spec.output_dim + 1))
            clock.mark("warm-up both")


def _check_warm_answer(model: ServedModel, kind: str, answer: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A warm-up answer as the spec promises it: ``shape``, float32, and the embeddings' columns finite (a score
    is the dense part's business)."""
    embeddings = answer[:, : model.spec.output_dim] if answer.dim() == 2 else None
    if tuple(answer.shape) == shape and answer.dtype == torch.float32:
        if embeddings is None or bool(torch.isfinite(embeddings).all()):
            return
        problem = "non-finite embeddings"
    else:
        problem = f"{answer.dtype} {list(answer.shape)} where {list(shape)} float32 was due"
    raise LoadError(
        f"model {model.name!r} version {model.version}: its warm-up {kind} answered {problem} "
        f"({model.runtime.path}); re-export the version"
    )


async def open_repository(path: str | Path, config: Any, metrics: ServerMetrics) -> Repository:
    """The repository of ``embserve serve REPO`` with every model loaded (and polled, with ``config.poll_s``)."""
    settings = BatchSettings(
        max_batch_size=config.max_batch_size,
        max_delay_s=config.max_delay_us / 1e6,
        max_queue=config.max_queue,
        workers=config.forward_threads or max(1, os.cpu_count() or 1),
        warmup_batches=config.warmup_batches,
        threads=config.threads,
        max_merge_examples=getattr(config, "max_merge_examples", MAX_MERGE_EXAMPLES),
        verify=getattr(config, "verify", "full"),
    )
    repository = Repository(path, settings, metrics, VersionPolicy.parse(config.version_policy))
    await repository.load_all()
    if config.poll_s:
        repository.start_polling(config.poll_s)
    return repository
