"""The malformed-manifest corpus (tests/support/bad_manifests.py) against both loaders.

C++: ``embserve_run ARTIFACT`` exits 1 with exactly one line naming ManifestError and the key; Python:
``infer.artifact.load.load`` raises ``ArtifactError(kind=MANIFEST)`` with the same fragment.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from tests.cpp.support import assert_clean_failure, run
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
    def one(case: BadManifest):  # type: ignore[no-untyped-def]
        return case, run(embserve_run, bad_artifacts[case.name], timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, BAD_MANIFESTS))
    failures = []
    for case, result in results:
        try:
            assert_clean_failure(result, "embserve_run: ManifestError: ", case.fragment)
        except AssertionError as err:
            failures.append(f"{case.name}: {err}")
    assert not failures, "\n".join(failures)
