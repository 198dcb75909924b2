"""embserve_run answers every request of a request file (issue 25): a typed error record for each bad one, results
for the rest, an exit status that says whether any failed, and ``--fail-fast`` to stop at the first failure.

Good requests sit around each bad one and must come back equal to Python's ``infer.load(dir)`` (bit for bit) and
to the fp32 reference (``F.embedding_bag`` on the dequantized tables, then the dense part by hand for predicts).
Bad requests come from the shared corpus (``tests/support/bad_requests.py``) and from raw records built here
byte by byte from the format in ``infer/artifact/cpp_io.py``; the expected fragments are written by hand.
"""

from __future__ import annotations

import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from infer.artifact.cpp_io import ResponseFile, read_response_file, read_responses, write_requests
from infer.artifact.load import load
from infer.errors import FileFormatError, RequestError
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights
from infer.reference import FloatEmbeddingBagCollection
from tests.cpp.conftest import DENSE_INPUTS, DenseArtifact
from tests.cpp.support import BACKTRACE_MARKERS, run, tensor_record
from tests.support.bad_requests import BAD_REQUESTS, CORPUS_SPEC, BadRequest

Request = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

# Two good requests of the corpus model (features f0 -> t0 [10 rows], f1 -> t1 [20 rows]; batch 2).
GOOD_BEFORE: Request = (torch.tensor([1, 2, 3, 19]), torch.tensor([1, 1, 1, 1], dtype=torch.int32), None)
GOOD_AFTER: Request = (
    torch.tensor([9, 0, 5, 7, 11], dtype=torch.int32),
    torch.tensor([2, 0, 1, 2], dtype=torch.int64),
    torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0]),
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The corpus model (quantized) and its exported artifact (model.pt)."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    model = quantize(CORPUS_SPEC, random_weights(CORPUS_SPEC, seed=25))
    return model, export(model, tmp_path_factory.mktemp("every") / "corpus")


def record(tensor: torch.Tensor | None) -> bytes:
    """A tensor record by hand: dtype code, ndim, int64 sizes, little-endian data (absent: one 0 byte)."""
    if tensor is None:
        return b"\x00"
    code = {torch.int32: 1, torch.int64: 2, torch.float32: 3}[tensor.dtype]
    return tensor_record(
        code, list(tensor.shape), tensor.contiguous().numpy().astype(tensor.numpy().dtype.newbyteorder("<")).tobytes()
    )


def request_bytes(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> bytes:
    return record(values) + record(lengths) + record(weights)


def request_file(*requests: bytes, count: int | None = None, magic: bytes = b"EMBSRQ01") -> bytes:
    return magic + struct.pack("<I", len(requests) if count is None else count) + b"".join(requests)


def run_file(
    embserve_run: Path, artifact: Path, data: bytes, folder: Path, *options: object
) -> tuple[subprocess.CompletedProcess[str], ResponseFile]:
    (folder / "r.bin").write_bytes(data)
    result = run(embserve_run, artifact, "--requests", folder / "r.bin", "--out", folder / "o.bin", *options)
    assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-2000:]
    return result, read_response_file(folder / "o.bin")


def expected_lookup(corpus, request: Request) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Python's answer, after checking it against the fp32 reference (embedding_bag on the dequantized tables)."""
    model, artifact = corpus
    batch = SparseFeatures(CORPUS_SPEC.feature_names, *request)
    reference = FloatEmbeddingBagCollection(CORPUS_SPEC, dequantized_weights(CORPUS_SPEC, model))(batch)
    python = load(artifact).lookup(batch)
    torch.testing.assert_close(python, reference, rtol=1e-5, atol=1e-5)
    return python


def assert_answered(responses: ResponseFile, index: int, expected: torch.Tensor) -> None:
    got = responses.records[index]
    assert got.ok and got.error is None, (index, got.error_type, got.message)
    assert got.output is not None and torch.equal(got.output, expected), index


@pytest.fixture(scope="module")
def good(corpus):  # type: ignore[no-untyped-def]
    """expected_lookup of GOOD_BEFORE and GOOD_AFTER, computed once for the module."""
    return {"before": expected_lookup(corpus, GOOD_BEFORE), "after": expected_lookup(corpus, GOOD_AFTER)}


@dataclass(frozen=True)
class Answered:
    """One request file of the module's shared run: its path, its stderr lines, its response file."""

    path: Path
    stderr: list[str]
    responses: ResponseFile


def bad_between_good(bad: bytes) -> bytes:
    return request_file(request_bytes(*GOOD_BEFORE), bad, request_bytes(*GOOD_AFTER))


def shared_run_files() -> dict[str, bytes]:
    """Every [good, bad, good] file of the corpus, FRAMED and UNFRAMED cases, by "group/case"."""
    files = {f"corpus/{c.name}": bad_between_good(request_bytes(c.values, c.lengths, c.weights)) for c in BAD_REQUESTS}
    files |= {f"framed/{name}": bad_between_good(bad) for name, (bad, _) in FRAMED.items()}
    files |= {f"unframed/{name}": bad_between_good(bad) for name, (bad, _) in UNFRAMED.items()}
    return files


@pytest.fixture(scope="module")
def shared_run(embserve_run, corpus, tmp_path_factory) -> dict[str, Answered]:  # type: ignore[no-untyped-def]
    """shared_run_files() answered by one embserve_run (one --requests/--out pair each; a start per file is ~0.3
    CPU-s of libtorch): each file's stderr lines (by their path prefix) and response file. The model answers them
    all, so a bad request that changed its state would show in the good ones after it.
    test_one_file_alone_is_answered_as_in_the_shared_run checks a file run alone gives the same."""
    root = tmp_path_factory.mktemp("shared_run")
    paths, args = {}, []
    for index, (key, data) in enumerate(shared_run_files().items()):
        paths[key] = root / f"{index}.bin"
        paths[key].write_bytes(data)
        args += ["--requests", paths[key], "--out", root / f"{index}.out"]
    result = run(embserve_run, corpus[1], *args)
    assert result.returncode == 1, result.stderr[-2000:]
    assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-2000:]
    lines = result.stderr.splitlines()
    answered = {}
    for key, path in paths.items():
        mine = [line for line in lines if line.startswith(f"embserve_run: {path}: ")]
        answered[key] = Answered(path, mine, read_response_file(path.with_suffix(".out")))
    assert sum(len(a.stderr) for a in answered.values()) == len(lines), result.stderr[-2000:]
    return answered


@pytest.mark.parametrize("key", ["corpus/" + BAD_REQUESTS[0].name, "framed/values absent", "unframed/negative size"])
def test_one_file_alone_is_answered_as_in_the_shared_run(key, embserve_run, corpus, shared_run, tmp_path):
    """One file of each group run alone: status 1, the same stderr lines (its path in them) and the same records."""
    result, responses = run_file(embserve_run, corpus[1], shared_run_files()[key], tmp_path)
    assert result.returncode == 1, result.stderr
    shared = shared_run[key]
    alone_lines = [line.replace(str(shared.path), str(tmp_path / "r.bin")) for line in shared.stderr]
    assert result.stderr.splitlines() == alone_lines
    assert (responses.requests, responses.file_error) == (shared.responses.requests, shared.responses.file_error)
    assert len(responses.records) == len(shared.responses.records)
    for alone, together in zip(responses.records, shared.responses.records, strict=True):
        assert (alone.error_type, alone.message) == (together.error_type, together.message)
        assert (alone.output is None) == (together.output is None)
        assert alone.output is None or torch.equal(alone.output, together.output)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_a_corpus_case_between_good_requests(case: BadRequest, shared_run, good):
    """[good, bad, good]: [result, RequestError with the corpus fragment, result], one stderr line."""
    answered = shared_run[f"corpus/{case.name}"]
    responses = answered.responses
    assert responses.requests == 3 and len(responses.records) == 3 and responses.file_error is None
    assert_answered(responses, 0, good["before"])
    assert_answered(responses, 2, good["after"])
    refused = responses.records[1]
    assert refused.error_type == "RequestError" and isinstance(refused.error, RequestError)
    assert case.fragment in (refused.message or ""), refused.message
    assert answered.stderr == [f"embserve_run: {answered.path}: request 1: RequestError: {refused.message}"]


LENGTHS = record(GOOD_BEFORE[1])
# Requests whose records are framed (every size known and inside the file) but cannot be a request: refused with a
# FileFormatError record; the reader goes on after them.
FRAMED = {
    "values absent": (b"\x00" + LENGTHS + b"\x00", "values is absent; every request needs values and lengths"),
    "lengths absent": (
        record(GOOD_BEFORE[0]) + b"\x00\x00",
        "lengths is absent; every request needs values and lengths",
    ),
    "nine dimensions": (
        tensor_record(2, [4] + [1] * 8, struct.pack("<4q", 1, 2, 3, 4)) + LENGTHS + b"\x00",
        "values has 9 dimensions, over the limit of 8",
    ),
    "a shape torch cannot hold": (  # no element, but its strides pass int64
        tensor_record(2, [0, 1 << 62, 4]) + LENGTHS + b"\x00",
        "values has shape [0, 4611686018427387904, 4], which torch cannot hold (Stride calculation overflowed)",
    ),
    "weights of nine dimensions": (
        record(GOOD_BEFORE[0]) + LENGTHS + tensor_record(3, [1] * 9, struct.pack("<f", 1.0)),
        "weights has 9 dimensions, over the limit of 8",
    ),
}


@pytest.mark.parametrize("case", sorted(FRAMED))
def test_a_framed_but_unusable_request_is_skipped(case, shared_run, good):
    message = FRAMED[case][1]
    answered = shared_run[f"framed/{case}"]
    responses = answered.responses
    assert len(responses.records) == 3 and responses.file_error is None
    assert_answered(responses, 0, good["before"])
    assert_answered(responses, 2, good["after"])
    refused = responses.records[1]
    assert (refused.error_type, refused.message) == ("FileFormatError", message)
    assert isinstance(refused.error, FileFormatError)
    assert answered.stderr == [f"embserve_run: {answered.path}: request 1: FileFormatError: {message}"]


# Records whose frame cannot be found: nothing after them can be located. Each is request 1 of 3.
UNFRAMED = {
    "unknown dtype code": (tensor_record(9, [4], bytes(32)) + LENGTHS + b"\x00", "values has unknown dtype code 9"),
    "negative size": (tensor_record(2, [-5]) + LENGTHS + b"\x00", "values has negative size -5 in dimension 0"),
    "elements overflow": (tensor_record(2, [1 << 62, 1 << 62]) + LENGTHS, "values has more elements than fit in 64"),
    "bytes overflow": (tensor_record(2, [1 << 62]) + LENGTHS, "values has 4611686018427387904 elements, more bytes"),
    "data past the end": (tensor_record(2, [1 << 40]) + LENGTHS, "values needs 8796093022208 bytes of data but only"),
    "lengths data past the end": (
        record(GOOD_BEFORE[0]) + tensor_record(1, [1000], bytes(16)),
        "lengths needs 4000 bytes of data but only",
    ),
}


@pytest.mark.parametrize("case", sorted(UNFRAMED))
def test_a_lost_frame_answers_the_requests_before_it(case, shared_run, good):
    """[good, unframed, good]: the first is answered; the closing record names request 1, its byte and why; the
    requests from there on are not answered (read_responses gives them the closing error)."""
    fragment = UNFRAMED[case][1]
    answered = shared_run[f"unframed/{case}"]
    responses = answered.responses
    assert responses.requests == 3 and len(responses.records) == 1
    assert_answered(responses, 0, good["before"])
    closing = responses.file_error
    assert closing is not None and closing.error_type == "FileFormatError"
    start = 8 + 4 + len(request_bytes(*GOOD_BEFORE))  # magic, count, request 0
    assert (closing.message or "").startswith(f"request 1 (from byte {start}) cannot be read: {fragment}")
    assert "requests 1-2 of 3 are not answered" in (closing.message or "")
    assert [r.error_type for r in read_responses(answered.path.with_suffix(".out"))] == [
        None,
        "FileFormatError",
        "FileFormatError",
    ]
    assert answered.stderr == [f"embserve_run: {answered.path}: FileFormatError: {closing.message}"]


def test_a_truncated_file_answers_the_requests_before_the_cut(embserve_run, corpus, tmp_path):
    good = request_bytes(*GOOD_BEFORE)
    data = request_file(good, good[:6], count=3)  # request 1 ends inside the size of its values (bytes 2-9)
    result, responses = run_file(embserve_run, corpus[1], data, tmp_path)
    assert result.returncode == 1, result.stderr
    assert len(responses.records) == 1 and responses.file_error is not None
    assert_answered(responses, 0, expected_lookup(corpus, GOOD_BEFORE))
    assert (responses.file_error.message or "").startswith(
        f"request 1 (from byte {12 + len(good)}) cannot be read: the file ends at byte {len(data)} inside the sizes "
        "of values; nothing after it can be located, so requests 1-2 of 3 are not answered"
    )


def test_bytes_after_the_last_request_are_the_files_error(embserve_run, corpus, tmp_path):
    data = request_file(request_bytes(*GOOD_BEFORE), request_bytes(*GOOD_AFTER)) + b"junk"
    result, responses = run_file(embserve_run, corpus[1], data, tmp_path)
    assert result.returncode == 1, result.stderr
    assert_answered(responses, 0, expected_lookup(corpus, GOOD_BEFORE))
    assert_answered(responses, 1, expected_lookup(corpus, GOOD_AFTER))
    assert responses.file_error is not None and responses.file_error.error_type == "FileFormatError"
    assert "has 4 bytes after its 2 requests" in (responses.file_error.message or "")
    assert len(result.stderr.splitlines()) == 1


UNREADABLE = {
    "bad magic": (b"EMBSRQ99" + struct.pack("<I", 1) + request_bytes(*GOOD_BEFORE), "is not an embserve request file"),
    "empty": (b"", "is not an embserve request file"),
    "no count": (b"EMBSRQ01", "ends inside its header"),
    "impossible count": (
        request_file(request_bytes(*GOOD_BEFORE), count=1 << 31),
        f"says it holds 2147483648 requests but {len(request_bytes(*GOOD_BEFORE))} bytes hold at most",
    ),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_file_that_cannot_be_read_at_all_is_status_2(case, embserve_run, corpus, tmp_path):
    data, fragment = UNREADABLE[case]
    result, responses = run_file(embserve_run, corpus[1], data, tmp_path)
    assert result.returncode == 2, result.stderr
    assert responses.requests == 0 and responses.records == () and read_responses(tmp_path / "o.bin") == []
    assert responses.file_error is not None and responses.file_error.error_type == "FileFormatError"
    assert fragment in (responses.file_error.message or "")
    assert result.stderr.splitlines() == [
        f"embserve_run: {tmp_path / 'r.bin'}: FileFormatError: {responses.file_error.message}"
    ]


def test_the_next_file_runs_after_one_that_cannot_be_read(embserve_run, corpus, tmp_path):
    """Without --fail-fast every --requests file runs; the status is the worst: 2 for the unreadable one."""
    (tmp_path / "bad.bin").write_bytes(b"EMBSRQ99")
    write_requests(tmp_path / "good.bin", [GOOD_BEFORE, GOOD_AFTER])
    args = ("--requests", tmp_path / "bad.bin", "--out", tmp_path / "bad.out")
    result = run(embserve_run, corpus[1], *args, "--requests", tmp_path / "good.bin", "--out", tmp_path / "good.out")
    assert result.returncode == 2, result.stderr
    good = read_response_file(tmp_path / "good.out")
    assert good.file_error is None
    assert_answered(good, 0, expected_lookup(corpus, GOOD_BEFORE))
    assert_answered(good, 1, expected_lookup(corpus, GOOD_AFTER))


def test_a_missing_request_file_is_status_2(embserve_run, corpus, tmp_path):
    result = run(embserve_run, corpus[1], "--requests", tmp_path / "nope.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"embserve_run: {tmp_path / 'nope.bin'}: FileFormatError: cannot be opened"]


def test_all_good_is_status_0(embserve_run, corpus, tmp_path):
    write_requests(tmp_path / "r.bin", [GOOD_BEFORE, GOOD_AFTER])
    result = run(embserve_run, corpus[1], "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 0 and result.stderr == ""
    responses = read_response_file(tmp_path / "o.bin")
    assert responses.file_error is None and len(responses.records) == 2


def test_fail_fast_stops_at_the_first_failure(embserve_run, corpus, tmp_path):
    """--fail-fast: [good, bad, good] answers the first two, the third is NotRun; the next file does not run."""
    bad = BAD_REQUESTS[0]
    write_requests(tmp_path / "r.bin", [GOOD_BEFORE, (bad.values, bad.lengths, bad.weights), GOOD_AFTER])
    write_requests(tmp_path / "next.bin", [GOOD_AFTER])
    pairs = ("--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    pairs += ("--requests", tmp_path / "next.bin", "--out", tmp_path / "next.out")
    result = run(embserve_run, corpus[1], *pairs, "--fail-fast")
    assert result.returncode == 1, result.stderr
    responses = read_response_file(tmp_path / "o.bin")
    assert len(responses.records) == 2
    assert_answered(responses, 0, expected_lookup(corpus, GOOD_BEFORE))
    assert responses.records[1].error_type == "RequestError" and bad.fragment in (responses.records[1].message or "")
    assert responses.file_error is not None
    assert responses.file_error.error_type == "NotRun"
    assert responses.file_error.message == "stopped after request 1 failed (--fail-fast): request 2 of 3 is not run"
    assert [r.error_type for r in read_responses(tmp_path / "o.bin")] == [None, "RequestError", "NotRun"]
    assert not (tmp_path / "next.out").exists()
    assert len(result.stderr.splitlines()) == 2  # the failed request, then the stop

    # without --fail-fast the same files are answered whole
    result = run(embserve_run, corpus[1], *pairs)
    assert result.returncode == 1
    assert [r.ok for r in read_responses(tmp_path / "o.bin")] == [True, False, True]
    assert_answered(read_response_file(tmp_path / "next.out"), 0, expected_lookup(corpus, GOOD_AFTER))


def test_fail_fast_stops_at_a_lost_frame(embserve_run, corpus, tmp_path):
    bad, fragment = UNFRAMED["unknown dtype code"]
    data = request_file(request_bytes(*GOOD_BEFORE), bad, request_bytes(*GOOD_AFTER))
    result, responses = run_file(embserve_run, corpus[1], data, tmp_path, "--fail-fast")
    assert result.returncode == 1
    assert len(responses.records) == 1 and responses.file_error is not None
    assert fragment in (responses.file_error.message or "")


def test_help_documents_the_exit_statuses(embserve_run):
    result = run(embserve_run, "--help")
    assert result.returncode == 0 and "--fail-fast" in result.stdout
    assert "exit status: 0 every request succeeded" in result.stdout
    assert "1 some request failed" in result.stdout and "2 usage error" in result.stdout
    assert run(embserve_run, "--no-such-flag").returncode == 2


def expected_scores(artifact: DenseArtifact, request: Request, dense_features: torch.Tensor) -> torch.Tensor:
    """Python's predict, after checking it against the fp32 reference: the dense part's linear layer by hand on
    [dense_features, embedding_bag of the dequantized tables]."""
    batch = SparseFeatures(artifact.spec.feature_names, *request)
    pooled = FloatEmbeddingBagCollection(artifact.spec, dequantized_weights(artifact.spec, artifact.model))(batch)
    linear = artifact.spec.dense_arch.linear  # type: ignore[union-attr]
    with torch.no_grad():
        reference = (torch.cat([dense_features, pooled], dim=1) @ linear.weight.T + linear.bias).reshape(-1)
    python = load(artifact.path).predict(batch, dense_features).reshape(-1)
    torch.testing.assert_close(python, reference, rtol=1e-5, atol=1e-5)
    return python


def test_predicts_between_bad_ones(embserve_run, dense_artifact, tmp_path):
    """A version 2 file: a predict, a predict with the wrong dense shape (RequestError), a lookup, a predict whose
    dense record has 9 dimensions (FileFormatError, skipped), a predict; then the same with a lost frame."""
    generator = torch.Generator().manual_seed(25)
    first = (torch.tensor([3, 49, 0, 29, 1]), torch.tensor([2, 0, 1, 2], dtype=torch.int32), None)
    second = (torch.tensor([7, 8, 9], dtype=torch.int32), torch.tensor([1, 1, 0, 1], dtype=torch.int64), None)
    dense_first = torch.randn(2, DENSE_INPUTS, generator=generator)
    dense_second = torch.randn(2, DENSE_INPUTS, generator=generator)
    nine_dims = tensor_record(3, [2, DENSE_INPUTS] + [1] * 7, bytes(4 * 2 * DENSE_INPUTS))
    data = request_file(
        request_bytes(*first) + record(dense_first),
        request_bytes(*first) + record(torch.zeros(2, DENSE_INPUTS + 1)),
        request_bytes(*second) + b"\x00",
        request_bytes(*second) + nine_dims,
        request_bytes(*second) + record(dense_second),
        magic=b"EMBSRQ02",
    )
    dense = dense_artifact
    result, responses = run_file(embserve_run, dense.path, data, tmp_path)
    assert result.returncode == 1, result.stderr
    assert responses.file_error is None and len(responses.records) == 5
    assert_answered(responses, 0, expected_scores(dense, first, dense_first))
    assert_answered(responses, 4, expected_scores(dense, second, dense_second))
    pooled = load(dense.path).lookup(SparseFeatures(dense.spec.feature_names, *second))
    reference = FloatEmbeddingBagCollection(dense.spec, dequantized_weights(dense.spec, dense.model))(
        SparseFeatures(dense.spec.feature_names, *second)
    )
    torch.testing.assert_close(pooled, reference, rtol=1e-5, atol=1e-5)
    assert_answered(responses, 2, pooled)
    wrong_shape, nine = responses.records[1], responses.records[3]
    assert wrong_shape.error_type == "RequestError"
    assert wrong_shape.message == f"dense_features must have shape [2, {DENSE_INPUTS}], got [2, {DENSE_INPUTS + 1}]"
    assert (nine.error_type, nine.message) == (
        "FileFormatError",
        "dense_features has 9 dimensions, over the limit of 8",
    )

    # a dense record pointing past the end of the file: the predict before it is still answered
    lost = request_bytes(*second) + tensor_record(3, [2, 1 << 20])
    result, responses = run_file(
        embserve_run, dense.path, request_file(data[12:], lost, count=6, magic=b"EMBSRQ02"), tmp_path
    )
    assert result.returncode == 1
    assert len(responses.records) == 5 and responses.file_error is not None
    assert_answered(responses, 4, expected_scores(dense, second, dense_second))
    assert "request 5 (from byte" in (responses.file_error.message or "")
    assert "dense_features needs 8388608 bytes of data" in (responses.file_error.message or "")


def test_bench_needs_a_file_whose_every_request_can_be_read(embserve_run, corpus, tmp_path):
    bad, message = FRAMED["values absent"]
    (tmp_path / "r.bin").write_bytes(request_file(request_bytes(*GOOD_BEFORE), bad))
    result = run(embserve_run, corpus[1], "--requests", tmp_path / "r.bin", "--bench", 5)
    assert result.returncode == 2 and result.stdout == ""
    prefix = f"embserve_run: {tmp_path / 'r.bin'}: --bench needs a file whose every request can be read"
    assert result.stderr.splitlines() == [f"{prefix}: request 1: {message}"]
