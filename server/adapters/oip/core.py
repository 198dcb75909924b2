"""The Open Inference Protocol's core (KServe v2), shared by its gRPC and REST adapters.

``OpenInference`` holds the protocol's calls, independent of gRPC or REST: an infer call is decoded by
``server.adapters.oip.codec`` (the per-feature tensor contract), validated like every embserve request, and
run on the shared pipeline (``server.pipeline``: its gate, batchers and metrics); ``ServedModel`` is one
version of one model as the protocol serves it, and a ``ModelSet`` (one artifact, or a model repository)
finds them. The gRPC adapter is ``server.adapters.oip.grpc_service``, the REST one
``server.adapters.oip.rest_server``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from infer import request_rules as rules
from infer.artifact.runtime import Runtime
from infer.errors import RequestError
from infer.version import __version__
from server.adapters.oip import codec as oc
from server.batcher import DynamicBatcher
from server.pipeline import Failure, Pipeline
from server.statistics import StageTimes, VersionStatistics
from server.validated import RequestLayout, ValidatedBatch

logger = logging.getLogger(__name__)

SERVER_NAME = "embserve"
PLATFORM = "embserve_torchscript"
BACKEND = "embserve"  # the model configuration's backend
EXTENSIONS = ("binary_tensor_data", "model_repository", "model_configuration", "statistics")


class ModelNotFound(Failure):
    """No such model, or no such version of it (NOT_FOUND; HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.NOT_FOUND, message, "not_found")


# ---------------------------------------------------------------------------------------- one model
class ServedModel:
    """One version of one model as the protocol serves it: runtime, batchers and metadata."""

    def __init__(
        self,
        name: str,
        version: str,
        runtime: Runtime,
        lookups: DynamicBatcher,
        predictions: DynamicBatcher | None,
        both: DynamicBatcher | None,
        max_batch_size: int,
    ) -> None:
        self.name = name
        self.version = version
        self.runtime = runtime
        self.spec = runtime.spec
        self.lookups = lookups
        self.predictions = predictions
        self.both = both
        self.max_batch_size = max_batch_size
        self.sha256 = runtime.manifest.file(runtime.manifest.model_file).sha256
        self._layout: RequestLayout | None = None
        self.statistics = VersionStatistics()
        self.count_executions(lookups, predictions, both)

    def count_executions(self, *batchers: DynamicBatcher | None) -> None:
        """This version's statistics count the forwards of ``batchers`` (its own; in single-artifact mode the
        pipeline's, which embserve.v1 calls share)."""
        for batcher in batchers:
            if batcher is not None:
                batcher.on_execution = self.statistics.execution

    @property
    def has_dense(self) -> bool:
        return self.predictions is not None

    def run_both(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        """Embeddings and scores of one forward, as columns ``[embeddings..., score]`` (the batcher splits rows)."""
        assert dense is not None
        pooled, scores = self.runtime.lookup_and_predict_unchecked(dense, values, lengths, weights)
        return torch.cat([pooled, scores.unsqueeze(1)], dim=1)

    async def infer(
        self, decoded: oc.Decoded, timing: StageTimes | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(embeddings, scores) of a validated request, through the shared batchers (``timing`` receives its
        stages' seconds)."""
        batch = decoded.batch
        if batch.batch_size > self.max_batch_size:
            raise RequestError(rules.too_large(batch.batch_size, self.max_batch_size))
        if decoded.mode is oc.Mode.LOOKUP:
            return await self.lookups.submit(batch, timing=timing), None
        if decoded.mode is oc.Mode.PREDICT:
            assert self.predictions is not None
            return None, await self.predictions.submit(batch, timing=timing)
        assert self.both is not None
        out = await self.both.submit(batch, timing=timing)
        return out[:, :-1], out[:, -1]

    @property
    def layout(self) -> RequestLayout:
        if self._layout is None:
            self._layout = RequestLayout.of(self.spec)
        return self._layout

    def decode(
        self,
        inputs: Callable[[], Sequence[oc.InputTensor]],
        requested: Sequence[oc.RequestedOutput],
        fp16: bool = False,
        raw: Callable[[], Iterable[oc.RawInput] | None] | None = None,
    ) -> oc.Decoded:
        """Decode and validate once: ``raw`` inputs (gRPC, when the request has them; else ``inputs``, e.g. REST's)
        read in place if plainly valid, else ``inputs`` through ``codec.decode_inputs``, which names what is
        wrong."""
        decoded_inputs = None
        if raw is not None:
            raw_inputs = raw()
        else:  # REST: inputs already decoded from JSON or binary data
            decoded_inputs = inputs()
            raw_inputs = [(t.name, t.datatype, t.shape, t.data.numpy()) for t in decoded_inputs]
        batch = oc.accept_raw(raw_inputs, self.layout) if raw_inputs is not None else None
        if batch is None:
            features, dense = oc.decode_inputs(decoded_inputs or inputs(), self.spec)
            if dense is not None and not self.has_dense:
                raise RequestError(f"this model has no dense part; drop the input {oc.DENSE!r}")
            batch = ValidatedBatch.of_features(features, dense)
        outputs, mode = oc.choose_outputs(requested, self.has_dense, batch.dense is not None, fp16)
        return oc.Decoded(batch, outputs, mode)

    def metadata(self, versions: Sequence[str]) -> dict[str, Any]:
        """The protocol's model metadata (JSON shape); gRPC converts it to ``ModelMetadataResponse``."""
        spec = self.spec
        inputs = []
        for feature in spec.feature_names:
            inputs += [
                {"name": f"{feature}__values", "datatype": "INT64", "shape": [-1]},
                {"name": f"{feature}__lengths", "datatype": "INT32", "shape": [-1]},
                {"name": f"{feature}__offsets", "datatype": "INT32", "shape": [-1]},
                {"name": f"{feature}__weights", "datatype": "FP32", "shape": [-1]},
            ]
        outputs = [{"name": oc.EMBEDDINGS, "datatype": "FP32", "shape": [-1, spec.output_dim]}]
        if self.has_dense:
            inputs.append({"name": oc.DENSE, "datatype": "FP32", "shape": [-1, spec.num_dense_features]})
            outputs.append({"name": oc.SCORES, "datatype": "FP32", "shape": [-1]})
        columns = {f.name: [f.column_start, f.column_end] for f in spec.features}
        properties = {
            "feature_order": ",".join(spec.feature_names),
            "columns": json.dumps(columns, separators=(",", ":")),
            "output_dim": str(spec.output_dim),
            "num_dense_features": str(spec.num_dense_features if self.has_dense else 0),
            "max_batch_size": str(self.max_batch_size),
            "model_sha256": self.sha256,
            "embserve_version": __version__,
            **{f"columns.{name}": f"{start}:{end}" for name, (start, end) in columns.items()},
            **{f"rows.{f.name}": str(f.num_embeddings) for f in spec.features},
        }
        return {
            "name": self.name,
            "versions": list(versions),
            "platform": PLATFORM,
            "inputs": inputs,
            "outputs": outputs,
            "properties": properties,
        }

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (its JSON shape; gRPC parses it into ``ModelConfig``): the tensors of the
        metadata with their whole shapes, ``max_batch_size`` 0 because the inputs are ragged (a client that
        put a batch dimension in front of ``<feature>__values`` would send ids of no bag), the server's largest
        request in the parameter ``max_batch_size``, and the batcher as dynamic batching."""
        metadata = self.metadata([self.version])
        required = {f"{feature}__values" for feature in self.spec.feature_names}

        def tensor(entry: dict[str, Any]) -> dict[str, Any]:
            return {"name": entry["name"], "data_type": f"TYPE_{entry['datatype']}", "dims": entry["shape"]}

        config: dict[str, Any] = {
            "name": self.name,
            "platform": PLATFORM,
            "backend": BACKEND,
            "max_batch_size": 0,
            "input": [{**tensor(t), "optional": t["name"] not in required} for t in metadata["inputs"]],
            "output": [tensor(t) for t in metadata["outputs"]],
            "parameters": {key: {"string_value": value} for key, value in metadata["properties"].items()},
        }
        if self.lookups.merges:
            config["dynamic_batching"] = {"max_queue_delay_microseconds": round(self.lookups.max_delay_s * 1e6)}
        return config


class ModelSet(Protocol):
    """Where the protocol finds its models: one artifact, or a repository of versions."""

    def lease(self, name: str, version: str) -> contextlib.AbstractAsyncContextManager[ServedModel]:
        """The model version to run a call on, held (not freed) until the call is done."""
        ...

    def find(self, name: str, version: str) -> ServedModel: ...

    def versions(self, name: str) -> list[str]: ...

    def served(self) -> list[ServedModel]:
        """Every loaded version of every model (the statistics of all models)."""
        ...

    def ready(self, name: str, version: str) -> bool: ...

    def failures(self, name: str) -> dict[str, str]:
        """version -> why it failed to load (reported in the model's metadata)."""
        ...

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        """The repository extension's index: name, version, state (READY/UNAVAILABLE) and reason."""
        ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...


class SingleModel:
    """One artifact served for the server's whole life (version "1"), on the embserve.v1 batchers."""

    VERSION = "1"

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def find(self, name: str, version: str) -> ServedModel:
        if name != self.model.name:
            raise ModelNotFound(f"unknown model {name!r}; this server serves {[self.model.name]}")
        if version not in ("", self.VERSION):
            raise ModelNotFound(f"model {name!r} has no version {version!r}; its versions are {[self.VERSION]}")
        return self.model

    @contextlib.asynccontextmanager
    async def lease(self, name: str, version: str) -> AsyncIterator[ServedModel]:
        yield self.find(name, version)

    def versions(self, name: str) -> list[str]:
        self.find(name, "")
        return [self.VERSION]

    def served(self) -> list[ServedModel]:
        return [self.model]

    def ready(self, name: str, version: str) -> bool:
        try:
            self.find(name, version)
        except ModelNotFound:
            return False
        return True

    def failures(self, name: str) -> dict[str, str]:
        return {}

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        return [{"name": self.model.name, "version": self.VERSION, "state": "READY", "reason": ""}]

    async def load(self, name: str) -> None:
        self.find(name, "")  # already loaded: loading it again is a no-op, as in Triton

    async def unload(self, name: str) -> None:
        self.find(name, "")
        raise Failure(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this server serves one artifact; start it on a repository (REPO/<model>/<version>/) to unload models",
            "unsupported",
        )


# ---------------------------------------------------------------------------------------- the protocol
@dataclass(frozen=True)
class InferResult:
    model: ServedModel
    outputs: list[oc.OutputTensor]


class OpenInference:
    """The protocol's calls, independent of gRPC or REST, on the shared pipeline (its batchers and metrics)."""

    def __init__(
        self,
        pipeline: Pipeline,
        models: ModelSet,
        stop_batchers: Sequence[DynamicBatcher] = (),
        repository: Any = None,
    ) -> None:
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.models = models
        self.repository = repository  # server.repository.Repository, closed with the protocol
        self.is_ready = False
        self._own_batchers = list(stop_batchers)
        self.http: Any = (
            None  # the REST server, when one runs (server.adapters.oip.rest_server.RestServer, set by server.app)
        )

    @classmethod
    def for_pipeline(cls, pipeline: Pipeline, name: str, max_queue: int) -> OpenInference:
        """The pipeline's default model as model ``name`` version "1", on its batchers."""
        lookups = pipeline.lookups
        both = None
        model = ServedModel(
            name, SingleModel.VERSION, pipeline.runtime, lookups, pipeline.predictions, None, pipeline.max_batch_size
        )
        if pipeline.predictions is not None:
            # embeddings and scores from one forward: a batcher of its own (its rows carry both)
            both = pipeline.batcher(
                model.run_both, max_queue, lookups.workers, lookups.max_delay_s, lookups.max_merge_examples
            )
            model.both = both
            model.count_executions(both)
        return cls(pipeline, SingleModel(model), [both] if both is not None else [])

    def start(self) -> None:
        for batcher in self._own_batchers:
            batcher.start()

    def stop_accepting(self) -> None:
        """The REST endpoint refuses new connections and closes each one after its next answer
        (``RestServer.stop_accepting``); model calls are refused once ``pipeline.closing`` is set. A repository's
        batches stop waiting for company."""
        if self.http is not None:
            self.http.stop_accepting()
        if self.repository is not None:
            self.repository.flush()

    async def close(self, grace: float | None = None, linger_s: float = 0.0) -> None:
        """Stop the REST endpoint (its calls in flight finish first, up to ``grace`` s; a connection kept alive
        gets its next request answered unless unused for ``linger_s``: ``RestServer.close``) and our batchers."""
        if self.http is not None:
            await self.http.close(grace, linger_s)
            self.http = None
        for batcher in self._own_batchers:
            await batcher.close()
        if self.repository is not None:
            await self.repository.close()

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str) -> dict[str, Any]:
        model = self.models.find(name, version)
        metadata = model.metadata(self.models.versions(name))
        failures = self.models.failures(name)
        if failures:
            metadata["properties"]["failed_versions"] = json.dumps(failures, sort_keys=True)
        return metadata

    def model_config(self, name: str, version: str) -> dict[str, Any]:
        """The configuration extension: Triton's ``ModelConfig`` of a model version, in its JSON shape."""
        return self.models.find(name, version).config()

    def model_statistics(self, name: str, version: str) -> dict[str, Any]:
        """The statistics extension: every loaded version of every model (no ``name``), of one model (no
        ``version``), or one version; an unknown model or version is NOT_FOUND as in ``model_metadata``."""
        if not name:
            models = self.models.served()
        elif version:
            models = [self.models.find(name, version)]
        else:
            models = [self.models.find(name, v) for v in self.models.versions(name)]
        return {"model_stats": [m.statistics.as_json(m.name, m.version) for m in models]}

    def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        return self.models.index(ready_only)

    def model_ready(self, name: str, version: str) -> bool:
        return self.is_ready and self.models.ready(name, version)

    async def infer(
        self,
        name: str,
        version: str,
        inputs: Callable[[], Sequence[oc.InputTensor]],
        requested: Sequence[oc.RequestedOutput],
        fp16: bool = False,
        raw: Callable[[], Iterable[oc.RawInput] | None] | None = None,
    ) -> InferResult:
        """Decode and validate once (``ServedModel.decode``: ``raw`` or ``inputs``, called once the model is
        known), batch, run and encode.

        ``fp16``: the request-level ``output_fp16`` (embeddings as FP16 unless an output says otherwise)."""
        started = time.perf_counter()
        pipeline = self.pipeline
        pipeline.accept()  # warm-up, draining
        async with self.models.lease(name, version) as model:
            timing = StageTimes()
            try:
                decoded = pipeline.decode(model.decode, inputs, requested, fp16, raw)
                decoded_at = time.perf_counter()
                embeddings, scores = await model.infer(decoded, timing)
                ran_at = time.perf_counter()
                outputs = pipeline.encode(oc.encode_outputs, decoded.outputs, embeddings, scores)
            except BaseException:  # refused, failed or cancelled: a failed request of this version
                model.statistics.request_failed(time.perf_counter() - started)
                raise
            finished = time.perf_counter()
            examples = decoded.batch.batch_size
            model.statistics.request_succeeded(
                examples, finished - started, decoded_at - started, finished - ran_at, timing
            )
            return InferResult(model, outputs)
