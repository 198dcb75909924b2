"""The malformed-manifest corpus (tests/support/bad_manifests.py) against both loaders.

C++: ``embserve_run --load-each`` says ManifestError and the key for each folder (one-folder run: exit 1,
exactly that one line on stderr); Python:
``infer.artifact.load.load`` raises ``ArtifactError(kind=MANIFEST)`` with the same fragment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from tests.cpp.support import assert_same_as_one_folder_run, load_each
from tests.support.bad_manifests import BAD_MANIFESTS, BadManifest


@pytest.fixture(scope="module")
def bad_artifacts(unsharded_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per case holding only the bad manifest.json (every case fails before any other file is read)."""
    good = (unsharded_artifact / "manifest.json").read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("bad_manifests")
    folders = {}
    for case in BAD_MANIFESTS:
        folder = root / case.name
        folder.mkdir()
        (folder / "manifest.json").write_bytes(case.render(good))
        folders[case.name] = folder
    return folders


def test_the_corpus_covers_issue_11(bad_artifacts):
    assert len(BAD_MANIFESTS) >= 22 and len({c.name for c in BAD_MANIFESTS}) == len(BAD_MANIFESTS)


@pytest.mark.parametrize("case", BAD_MANIFESTS, ids=lambda c: c.name)
def test_python_loader_rejects(case: BadManifest, bad_artifacts):
    with pytest.raises(ArtifactError) as info:
        load(bad_artifacts[case.name])
    assert info.value.kind == ArtifactErrorKind.MANIFEST, (case.name, str(info.value))
    assert case.fragment in str(info.value), (case.name, str(info.value))


def test_cpp_loader_rejects(embserve_run, bad_artifacts):
    """Every case's folder in one embserve_run --load-each (a start per case is ~0.3 CPU-s of libtorch); the first
    case's one-folder run shows the batched words are the real stderr line and status."""
    folders = [bad_artifacts[case.name] for case in BAD_MANIFESTS]
    outcomes = load_each(embserve_run, folders, timeout=120)
    failures = [
        f"{case.name}: {outcome}"
        for case, outcome in zip(BAD_MANIFESTS, (outcomes[f] for f in folders), strict=True)
        if not (outcome.startswith("ManifestError: ") and case.fragment in outcome)
    ]
    assert not failures, "\n".join(failures)
    assert_same_as_one_folder_run(embserve_run, folders[0], outcomes[folders[0]])
