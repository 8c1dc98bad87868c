import datetime
import hashlib
import http.client
import io
import os
import pickle
import shutil
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import scipy.sparse
import torch

import graphattn.datasets as ds
from graphattn.datasets import (
    ChecksumError,
    CorruptFileError,
    MissingFilesError,
    load_planetoid,
)
from graphattn.pe import AddLaplacianPE

REPO = Path(__file__).resolve().parents[1]
PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]
STRUCTURE = ["y", "ty", "ally", "graph", "test.index"]
# Documented statistics of the Planetoid datasets (torch_geometric.datasets.Planetoid docs).
STATS = {"Cora": (2708, 10556, 1433, 7), "CiteSeer": (3327, 9104, 3703, 6),
         "PubMed": (19717, 88648, 500, 3)}


def published_sums() -> dict[str, str]:
    """``datasets/SHA256SUMS`` read as file name -> sum."""
    sums = {}
    for line in (REPO / "datasets" / "SHA256SUMS").read_text().splitlines():
        digest, path = line.split()
        sums[Path(path).name] = digest
    return sums


def source_dir(name: str, parts: list[str]) -> Path:
    """A folder holding the given raw files of ``name``, or skip."""
    candidates = [Path(os.environ["GRAPHATTN_DATA"])] if os.environ.get("GRAPHATTN_DATA") else []
    candidates += [REPO / "datasets", REPO.parent / "shared" / "datasets"]
    for root in candidates:
        folder = root / name / "raw"
        if all((folder / f"ind.{name.lower()}.{p}").is_file() for p in parts):
            return folder
    pytest.skip(f"raw {name} files ({', '.join(parts)}) not found under "
                f"{[str(c) for c in candidates]}; .ci/run copies them into datasets/")


def copy_raw(name: str, root: Path, parts: list[str]) -> Path:
    """Copy the given raw files of ``name`` into ``root/<Name>/raw``; returns that folder."""
    src = source_dir(name, parts)
    dst = root / name / "raw"
    dst.mkdir(parents=True)
    for p in parts:
        shutil.copyfile(src / f"ind.{name.lower()}.{p}", dst / f"ind.{name.lower()}.{p}")
    return dst


@pytest.fixture
def offline(monkeypatch):
    """No network: every download attempt fails like a machine without internet."""
    calls = []

    def refuse(url, timeout=None):
        calls.append(url)
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(ds, "urlopen", refuse)
    return calls


class FakeResponse(io.BytesIO):
    def __init__(self, payload: bytes):
        super().__init__(payload)
        self.headers = {"Content-Length": str(len(payload))}


def serve(monkeypatch, files: dict[str, bytes]) -> list[str]:
    """Make ``urlopen`` answer Planetoid URLs with ``files`` (name -> bytes)."""
    calls = []

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        assert url.startswith(ds.PLANETOID_URL + "/"), url
        return FakeResponse(files[url.rsplit("/", 1)[1]])

    monkeypatch.setattr(ds, "urlopen", fake_urlopen)
    return calls


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_documented_statistics_and_split(name):
    num_nodes, num_edges, num_features, num_classes = STATS[name]
    root = source_dir(name, PARTS).parent.parent
    data = load_planetoid(name, root, download=False)
    assert data.num_nodes == num_nodes and data.x.shape == (num_nodes, num_features)
    assert data.edge_index.shape == (2, num_edges) and data.edge_index.dtype == torch.int64
    assert int(data.y.max()) + 1 == num_classes and data.y.dtype == torch.int64
    assert data.x.dtype == torch.float32

    # 20 per class for training, then 500 validation nodes, 1000 test nodes, all disjoint.
    assert torch.equal(data.y[data.train_mask].bincount(), torch.full((num_classes,), 20))
    assert int(data.val_mask.sum()) == 500 and int(data.test_mask.sum()) == 1000
    assert not (data.train_mask & data.val_mask).any()
    assert not ((data.train_mask | data.val_mask) & data.test_mask).any()

    # Undirected, no self-loops, no duplicates.
    pairs = set(map(tuple, data.edge_index.t().tolist()))
    assert len(pairs) == num_edges
    assert all((j, i) in pairs for i, j in pairs)
    assert all(i != j for i, j in pairs)

    # Row-normalised: each row sums to 1, or is all zero.
    sums = data.x.sum(dim=1)
    ones = torch.isclose(sums, torch.ones_like(sums))
    assert (ones | (sums == 0)).all()
    assert ones.float().mean() > 0.99


@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_matches_torch_geometric_planetoid(name, tmp_path):
    from torch_geometric.datasets import Planetoid
    from torch_geometric.transforms import NormalizeFeatures

    copy_raw(name, tmp_path, PARTS)
    ref = Planetoid(str(tmp_path), name, transform=NormalizeFeatures())[0]
    data = load_planetoid(name, tmp_path, download=False)
    torch.testing.assert_close(data.x, ref.x)
    for key in ("y", "edge_index", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(data, key), getattr(ref, key)), key


def test_citeseer_isolated_test_nodes_are_zero_padded():
    root = source_dir("CiteSeer", PARTS).parent.parent
    data = load_planetoid("CiteSeer", root, download=False)
    split = data.train_mask | data.val_mask | data.test_mask
    padded = (data.x.abs().sum(dim=1) == 0) & (torch.arange(data.num_nodes) >= 2312) & ~split
    assert int(padded.sum()) == 15  # 3327 - 2312 - 1000 test nodes
    assert (data.y[padded] == 0).all()


def test_name_is_case_insensitive():
    root = source_dir("Cora", PARTS).parent.parent
    a = load_planetoid("cora", root, download=False)
    b = load_planetoid("CORA", root, download=False)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)


def test_transform_is_applied_to_the_loaded_graph():
    root = source_dir("Cora", PARTS).parent.parent
    seen = []
    data = load_planetoid("Cora", root, transform=lambda d: seen.append(d) or "transformed")
    assert data == "transformed" and len(seen) == 1  # called once, its result returned
    assert torch.equal(seen[0].x, load_planetoid("Cora", root).x)  # on the loaded graph
    data = load_planetoid("Cora", root, transform=AddLaplacianPE(4))
    assert data.laplacian_pe.shape == (2708, 4) and torch.isfinite(data.laplacian_pe).all()
    with pytest.raises(TypeError, match="transform must be callable .*got str"):
        load_planetoid("Cora", root, transform="AddLaplacianPE")


def test_root_and_flags_are_checked_by_name(tmp_path):
    """root=3 failed inside pathlib ("expected str, bytes or os.PathLike object"), and
    download="no" downloaded."""
    with pytest.raises(TypeError, match=r"root must be a path \(a str or os.PathLike\) or None, "
                                        r"got 3 \(a int\)"):
        load_planetoid("Cora", 3)
    for flag in ("download", "progress", "structure_only"):
        with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'no' \(a str\)"):
            load_planetoid("Cora", tmp_path, **{flag: "no"})
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_unknown_name_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"name must be one of \['Cora', 'CiteSeer', 'PubMed'\]"
                                         r".*got 'Reddit'"):
        load_planetoid("Reddit", tmp_path)
    for name in (None, 7, b"cora"):  # not a string: the same message, not an AttributeError
        with pytest.raises(ValueError, match=f"name must be one of .*got {name!r}"):
            load_planetoid(name, tmp_path)


def test_offline_and_missing_names_files_source_and_folder(tmp_path, offline):
    with pytest.raises(MissingFilesError) as info:
        load_planetoid("Cora", tmp_path)
    msg = str(info.value)
    folder = tmp_path / "Cora" / "raw"
    assert "8 raw file(s) missing" in msg and str(folder) in msg
    assert "Name or service not known" in msg
    assert "github.com/kimiyoung/planetoid" in msg
    for part in PARTS:
        assert f"https://github.com/kimiyoung/planetoid/raw/master/data/ind.cora.{part}" in msg
    assert len(offline) == 1  # gives up after the first failed download
    assert "structure_only" not in msg  # it would not help: structure files are missing too
    # no partial file, and no folder made for the download: a mistyped root leaves no trace
    assert list(tmp_path.iterdir()) == []


def test_download_false_never_touches_the_network(tmp_path, offline):
    with pytest.raises(MissingFilesError, match="download=False"):
        load_planetoid("Cora", tmp_path, download=False)
    assert offline == []


def test_pubmed_without_allx_raises_clear_error(tmp_path, offline):
    copy_raw("PubMed", tmp_path, [p for p in PARTS if p != "allx"])
    with pytest.raises(MissingFilesError) as info:
        load_planetoid("pubmed", tmp_path)
    msg = str(info.value)
    assert "1 raw file(s) missing" in msg and "ind.pubmed.allx" in msg
    assert "https://github.com/kimiyoung/planetoid/raw/master/data/ind.pubmed.allx" in msg
    assert str(tmp_path / "PubMed" / "raw") in msg
    # the call to run instead, with the root given (the default root holds no files)
    assert f"load_planetoid('PubMed', root={str(tmp_path)!r}, structure_only=True)" in msg


@pytest.mark.parametrize("parts", ["graph", ("graph", "features"), None])
def test_ensure_raw_files_refuses_unknown_parts(tmp_path, parts):
    """A str was split into letters (ind.cora.g, ind.cora.r, ... missing); an unknown part was
    a bare KeyError."""
    with pytest.raises(ValueError, match=r"parts must be a sequence of names from \("):
        ds.ensure_raw_files("Cora", tmp_path, parts, download=False)


@pytest.mark.parametrize("flag", ["download", "progress"])
def test_ensure_raw_files_refuses_flags_that_are_no_bools(tmp_path, flag, offline):
    """download="False" was read by its truth value, and fetched the files."""
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'False' \(a str\)"):
        ds.ensure_raw_files("Cora", tmp_path, ("y",), **{flag: "False"})


def test_pubmed_structure_only(tmp_path, offline):
    copy_raw("PubMed", tmp_path, STRUCTURE)
    data = load_planetoid("PubMed", tmp_path, structure_only=True)
    num_nodes, num_edges, _, num_classes = STATS["PubMed"]
    assert data.x is None and data.num_nodes == num_nodes
    assert data.edge_index.shape == (2, num_edges)
    assert torch.equal(data.y[data.train_mask].bincount(), torch.full((num_classes,), 20))
    assert int(data.val_mask.sum()) == 500 and int(data.test_mask.sum()) == 1000
    assert offline == []


def test_download_verifies_and_renames(tmp_path, monkeypatch):
    src = source_dir("Cora", PARTS)
    files = {f"ind.cora.{p}": (src / f"ind.cora.{p}").read_bytes() for p in PARTS}
    calls = serve(monkeypatch, files)
    data = load_planetoid("Cora", tmp_path, progress=False)
    assert len(calls) == 8
    folder = tmp_path / "Cora" / "raw"
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    reference = load_planetoid("Cora", src.parent.parent, download=False)
    assert torch.equal(data.x, reference.x) and torch.equal(data.edge_index, reference.edge_index)


@pytest.mark.skipif(os.name != "posix", reason="file modes and umask are POSIX")
def test_downloaded_file_mode_follows_the_umask(tmp_path, monkeypatch):
    # A shared data root must stay readable by others: the renamed temporary file may not keep
    # mkstemp's 0600 mode.
    src = source_dir("Cora", ["y"])
    serve(monkeypatch, {"ind.cora.y": (src / "ind.cora.y").read_bytes()})
    old = os.umask(0o022)
    try:
        ds.ensure_raw_files("Cora", tmp_path, ("y",), progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "Cora" / "raw" / "ind.cora.y").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("cut", ["short body", "IncompleteRead"])
def test_download_cut_short_is_a_failed_download(tmp_path, monkeypatch, cut):
    payload = source_dir("Cora", ["x"]).joinpath("ind.cora.x").read_bytes()

    class Cut(FakeResponse):
        def __init__(self):
            super().__init__(payload[: len(payload) // 3])
            self.headers = {"Content-Length": str(len(payload))}  # promised: all of it

        def read(self, n=-1):
            if cut == "IncompleteRead":
                raise http.client.IncompleteRead(b"", 100)
            return super().read(n)

    monkeypatch.setattr(ds, "urlopen", lambda url, timeout=None: Cut())
    with pytest.raises(MissingFilesError, match=r"download failed: .*ind\.cora\.x") as info:
        load_planetoid("Cora", tmp_path, progress=False)
    assert "put them into" in str(info.value)
    assert list(tmp_path.iterdir()) == [], "no partial files or new folders may be left behind"


def test_malformed_http_response_is_a_failed_download(tmp_path, monkeypatch):
    # urlopen itself raises http.client errors that are not OSErrors (a proxy answering garbage).
    def garbage(url, timeout=None):
        raise http.client.BadStatusLine("HTTP/1.1 garbage")

    monkeypatch.setattr(ds, "urlopen", garbage)
    with pytest.raises(MissingFilesError, match=r"download failed: .*ind\.cora\.x: BadStatusLine"):
        load_planetoid("Cora", tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == [], "no partial files or new folders may be left behind"


def test_failed_download_keeps_the_folders_that_were_there(tmp_path, monkeypatch):
    """Folders the download made are removed when it fails, innermost first; those that were
    there before, and any that holds a file, stay."""
    def offline(url, timeout=None):
        raise URLError("offline")

    monkeypatch.setattr(ds, "urlopen", offline)
    (tmp_path / "Cora").mkdir()
    with pytest.raises(URLError):
        ds.download_file("https://example/x", tmp_path / "Cora" / "raw" / "deep" / "x", "0" * 64,
                         progress=False)
    assert [p.name for p in tmp_path.rglob("*")] == ["Cora"]
    (tmp_path / "Cora" / "raw").mkdir()
    (tmp_path / "Cora" / "raw" / "ind.cora.y").write_bytes(b"y")
    with pytest.raises(URLError):
        ds.download_file("https://example/x", tmp_path / "Cora" / "raw" / "x", "0" * 64,
                         progress=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["Cora", "ind.cora.y", "raw"]


def test_root_expands_the_home_folder(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert ds.raw_dir("Cora", "~/data") == tmp_path / "home" / "data" / "Cora" / "raw"
    copy_raw("Cora", tmp_path / "home" / "data", STRUCTURE)
    data = load_planetoid("Cora", "~/data", structure_only=True)
    assert data.num_nodes == STATS["Cora"][0]
    assert not (tmp_path / "~").exists()


def leave_stale_parts(folder: Path, parts: list[str]) -> dict[Path, bytes]:
    """What interrupted downloads of ``parts`` leave in ``folder``, name -> bytes: this
    module's temporary files of runs killed before their cleanup (garbage of the full size, and
    the full file, killed between its last byte and the rename), and a prefix under the name
    other downloaders (wget, PyG) use."""
    src = source_dir("Cora", parts)
    folder.mkdir(parents=True, exist_ok=True)
    stale = {}
    for part in parts:
        payload = (src / f"ind.cora.{part}").read_bytes()
        stale[folder / f".ind.cora.{part}.0123456789abcdef.part"] = b"\x80" * len(payload)
        stale[folder / f".ind.cora.{part}.fedcba9876543210.part"] = payload
        stale[folder / f"ind.cora.{part}.part"] = payload[: len(payload) // 2]
    for path, data in stale.items():
        path.write_bytes(data)
    return stale


def test_stale_partial_download_is_downloaded_again(tmp_path, monkeypatch):
    folder = tmp_path / "Cora" / "raw"
    stale = leave_stale_parts(folder, ["x", "allx"])
    src = source_dir("Cora", PARTS)
    calls = serve(monkeypatch, {f"ind.cora.{p}": (src / f"ind.cora.{p}").read_bytes()
                                for p in PARTS})
    data = load_planetoid("Cora", tmp_path, progress=False)
    assert sorted(url.rsplit("/", 1)[1] for url in calls) == sorted(f"ind.cora.{p}" for p in PARTS)
    reference = load_planetoid("Cora", src.parent.parent, download=False)
    assert torch.equal(data.x, reference.x) and torch.equal(data.y, reference.y)
    # Left as they were: another process may still be writing one of them.
    assert {p: p.read_bytes() for p in folder.glob("*part")} == stale
    assert sorted(p.name for p in folder.glob("ind.cora.*") if p.suffix != ".part") == sorted(
        f"ind.cora.{p}" for p in PARTS)


def test_stale_partial_download_is_not_the_file(tmp_path, offline):
    # Even a complete one: only a verified rename makes ind.cora.x.
    folder = copy_raw("Cora", tmp_path, [p for p in PARTS if p != "x"])
    leave_stale_parts(folder, ["x"])
    with pytest.raises(MissingFilesError, match=r"1 raw file\(s\) missing .*: ind\.cora\.x\."):
        load_planetoid("Cora", tmp_path, download=False)
    with pytest.raises(MissingFilesError, match=r"download failed: .*ind\.cora\.x\."):
        load_planetoid("Cora", tmp_path)
    assert len(offline) == 1
    data = load_planetoid("Cora", tmp_path, structure_only=True)  # x is not needed there
    assert data.num_nodes == 2708


def test_download_with_wrong_checksum_is_discarded(tmp_path, monkeypatch):
    src = source_dir("Cora", PARTS)
    files = {f"ind.cora.{p}": (src / f"ind.cora.{p}").read_bytes() for p in PARTS}
    files["ind.cora.x"] = files["ind.cora.x"] + b"tampered"
    serve(monkeypatch, files)
    actual = hashlib.sha256(files["ind.cora.x"]).hexdigest()
    with pytest.raises(ChecksumError) as info:
        load_planetoid("Cora", tmp_path, progress=False)
    msg = str(info.value)
    assert "ind.cora.x" in msg and actual in msg and published_sums()["ind.cora.x"] in msg
    assert not (tmp_path / "Cora" / "raw" / "ind.cora.x").exists()
    assert not list((tmp_path / "Cora" / "raw").glob(".*part"))


@pytest.mark.parametrize("part", PARTS)
def test_local_checksum_mismatch_is_never_parsed(tmp_path, monkeypatch, offline, part):
    """Every part is checked (mutation testing: skipping the last, test.index, went unnoticed
    while only the graph file was corrupted here)."""
    folder = copy_raw("Cora", tmp_path, PARTS)
    name = f"ind.cora.{part}"
    with open(folder / name, "ab") as f:
        f.write(b"\0")
    actual = hashlib.sha256((folder / name).read_bytes()).hexdigest()

    def no_parsing(*args):
        raise AssertionError("a file with a wrong checksum was parsed")

    monkeypatch.setattr(ds, "_read_part", no_parsing)
    with pytest.raises(ChecksumError) as info:
        load_planetoid("Cora", tmp_path)
    msg = str(info.value)
    assert name in msg and actual in msg
    assert published_sums()[name] in msg


@pytest.mark.parametrize("part, message", [
    ("x", r"ind\.cora\.x cannot be read as a Planetoid file \(UnpicklingError"),
    ("graph", r"ind\.cora\.graph cannot be read as a Planetoid file \(EOFError"),
    ("ally", r"ind\.cora\.ally cannot be read as a Planetoid file"),
    ("test.index", r"do not fit together: ind\.cora\.test\.index lists 500 nodes but "
                   r"ind\.cora\.ty has 1000 rows"),
])
def test_truncated_file_gives_clear_error(tmp_path, monkeypatch, offline, part, message):
    folder = copy_raw("Cora", tmp_path, PARTS)
    path = folder / f"ind.cora.{part}"
    payload = path.read_bytes()
    path.write_bytes(payload[: len(payload) // 2])
    # The checksum would stop the truncated file; accept it so the parser meets it.
    monkeypatch.setitem(ds.SHA256, path.name, hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(CorruptFileError, match=message) as info:
        load_planetoid("Cora", tmp_path)
    assert "Delete" in str(info.value)


def test_unpickler_refuses_foreign_objects(tmp_path, monkeypatch, offline):
    folder = copy_raw("Cora", tmp_path, PARTS)
    path = folder / "ind.cora.y"
    path.write_bytes(pickle.dumps(datetime.date(2020, 1, 1), protocol=2))
    monkeypatch.setitem(ds.SHA256, path.name, hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(CorruptFileError, match=r"refusing to build datetime\.date"):
        load_planetoid("Cora", tmp_path)


def test_sha256sums_file_matches_table_and_files():
    assert published_sums() == ds.SHA256
    for name in ("Cora", "CiteSeer", "PubMed"):
        for part in PARTS:
            fname = f"ind.{name.lower()}.{part}"
            for root in (REPO / "datasets", REPO.parent / "shared" / "datasets"):
                path = root / name / "raw" / fname
                if path.is_file():
                    assert hashlib.sha256(path.read_bytes()).hexdigest() == ds.SHA256[fname]


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHATTN_DATA", str(tmp_path / "data"))
    assert ds.default_root() == tmp_path / "data"
    assert ds.raw_dir("citeseer") == tmp_path / "data" / "CiteSeer" / "raw"

    # an editable install (or the checkout on sys.path): the checkout's datasets/; the package
    # installed as a wheel: the user cache (below)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    editable = Path(ds.__file__).resolve().parents[1] == REPO
    expected = REPO / "datasets" if editable else tmp_path / "cache" / "graphattn"
    monkeypatch.setenv("GRAPHATTN_DATA", "")  # set but empty: as if unset, not the cwd
    assert ds.default_root() == expected
    monkeypatch.delenv("GRAPHATTN_DATA")
    assert ds.default_root() == expected

    # Installed as a wheel: no datasets/SHA256SUMS next to the package -> the user cache.
    wheel = tmp_path / "site-packages" / "graphattn"
    wheel.mkdir(parents=True)
    (wheel.parent / "datasets").mkdir()  # another package named datasets (Hugging Face's)
    monkeypatch.setattr(ds, "__file__", str(wheel / "datasets.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert ds.default_root() == tmp_path / "cache" / "graphattn"


def write_tiny_planetoid(root: Path, monkeypatch, **override) -> Path:
    """A hand-made "Cora" in the Planetoid format, with its sums accepted: 2 training nodes of 2
    classes, exactly the 500 validation nodes after them (ally holds 502 rows), and 2 test nodes
    listed as 503, 502; ``override`` replaces parts (part name -> object, "test.index" -> text)."""
    folder = root / "Cora" / "raw"
    folder.mkdir(parents=True)
    one_hot = [[1.0, 0.0], [0.0, 1.0]]
    parts = {"x": np.ones((2, 3)), "y": np.array(one_hot), "allx": np.ones((502, 3)),
             "ally": np.array(one_hot * 251), "tx": np.ones((2, 3)), "ty": np.array(one_hot),
             "graph": {0: [1], 1: [0], 502: [503], 503: [502]}, "test.index": "503\n502\n"}
    parts.update(override)
    for part, obj in parts.items():
        path = folder / f"ind.cora.{part}"
        if part == "test.index":
            path.write_text(obj)
        else:  # numpy 2 names its module numpy._core, scipy scipy.sparse._csr; the published
            # pickles say numpy.core and scipy.sparse.csr
            path.write_bytes(pickle.dumps(obj, protocol=3)
                             .replace(b"numpy._core.", b"numpy.core.")
                             .replace(b"scipy.sparse._csr\n", b"scipy.sparse.csr\n"))
        monkeypatch.setitem(ds.SHA256, path.name, hashlib.sha256(path.read_bytes()).hexdigest())
    return folder


def broken_csr() -> scipy.sparse.csr_matrix:
    """A 2 x 3 CSR matrix whose last stored entry has column index 7."""
    m = scipy.sparse.csr_matrix(np.ones((2, 3), dtype=np.float32))
    m.indices[-1] = 7  # toarray would write it past the dense rows
    return m


def test_tiny_planetoid_with_all_500_validation_nodes_loads(tmp_path, monkeypatch, offline):
    write_tiny_planetoid(tmp_path, monkeypatch)
    data = load_planetoid("Cora", tmp_path)
    assert data.num_nodes == 504 and data.x.shape == (504, 3)
    assert data.train_mask[:2].all() and int(data.train_mask.sum()) == 2
    assert data.val_mask[2:502].all() and int(data.val_mask.sum()) == 500
    assert data.test_mask[502:].all() and int(data.test_mask.sum()) == 2
    # ty's rows belong to the listed nodes in file order: 503 is class 0, 502 class 1
    assert data.y[:4].tolist() == [0, 1, 0, 1] and data.y[502:].tolist() == [1, 0]
    assert data.edge_index.tolist() == [[1, 0, 503, 502], [0, 1, 502, 503]]


@pytest.mark.parametrize("override, message", [
    ({"test.index": "504\n503\n"},
     r"ind\.cora\.test\.index starts at node 503 but ind\.cora\.ally has 502 rows"),
    ({"graph": {0: [504]}}, r"ind\.cora\.graph has node ids outside \[0, 504\) \(from 0 to 504\)"),
    ({"graph": {0: [-1]}}, r"ind\.cora\.graph has node ids outside \[0, 504\) \(from -1 to 0\)"),
    ({"graph": {0: [1], 504: []}}, r"ind\.cora\.graph has node ids outside \[0, 504\)"),
    ({"tx": np.ones((2, 4))}, r"the feature files disagree on the number of features \(columns\): "
                              r"ind\.cora\.x has 3, ind\.cora\.tx 4, ind\.cora\.allx 3"),
    ({"x": np.ones((2, 4))}, r"ind\.cora\.x has 4, ind\.cora\.tx 3, ind\.cora\.allx 3"),
    ({"ally": np.array([[1.0, 0.0], [0.0, 1.0]] * 250), "allx": np.ones((500, 3))},
     r"ind\.cora\.y has 2 rows \(training nodes\) but ind\.cora\.ally only 500"),
    # rows of features and labels, and of ty and test.index, that disagree
    ({"allx": np.ones((501, 3))}, r"ind\.cora\.allx has 501 rows but ind\.cora\.ally has 502"),
    ({"allx": np.ones((503, 3))}, r"ind\.cora\.allx has 503 rows but ind\.cora\.ally has 502"),
    ({"x": np.ones((3, 3))}, r"ind\.cora\.x has 3 rows but ind\.cora\.y has 2"),
    ({"tx": np.ones((1, 3))}, r"ind\.cora\.tx has 1 rows but ind\.cora\.ty has 2"),
    ({"tx": np.ones((3, 3))}, r"ind\.cora\.tx has 3 rows but ind\.cora\.ty has 2"),
    ({"ty": np.ones((3, 2))}, r"ind\.cora\.test\.index lists 2 nodes but ind\.cora\.ty has 3 rows"),
    ({"ally": np.ones((503, 2)), "allx": np.ones((503, 3))},
     r"ind\.cora\.test\.index starts at node 502 but ind\.cora\.ally has 503 rows"),
    # label widths (classes)
    ({"y": np.ones((2, 3))}, r"the label files disagree on the number of classes \(columns\): "
                             r"ind\.cora\.y has 3, ind\.cora\.ty 2, ind\.cora\.ally 2"),
    ({"ty": np.ones((2, 1))}, r"ind\.cora\.y has 2, ind\.cora\.ty 1, ind\.cora\.ally 2"),
    ({"y": np.ones((2, 0)), "ty": np.ones((2, 0)), "ally": np.ones((502, 0))},
     r"the label files have no columns \(classes\): ind\.cora\.y has 0"),
    # test.index: empty, repeated nodes, skipped ids past the graph's nodes
    ({"test.index": "", "tx": np.ones((0, 3)), "ty": np.ones((0, 2))},
     r"ind\.cora\.test\.index lists no nodes"),
    ({"test.index": "502\n502\n"},
     r"ind\.cora\.test\.index lists 1 node\(s\) more than once \(node 502 2 times\)"),
    ({"test.index": "503\n502\n503\n", "tx": np.ones((3, 3)), "ty": np.ones((3, 2))},
     r"ind\.cora\.test\.index lists 1 node\(s\) more than once \(node 503 2 times\)"),
    ({"test.index": "502\n600\n"}, r"ind\.cora\.test\.index skips 97 node ids up to node 600, "
                                   r"past the last node 503 of ind\.cora\.graph"),
    ({"test.index": "502\n100000000000\n"},  # not 1.5 TiB of zero rows
     r"ind\.cora\.test\.index skips 99999999497 node ids up to node 100000000000"),
    # node ids that are not int64 integers
    ({"graph": {0: [2**70]}}, r"ind\.cora\.graph does not hold adjacency lists of node ids "
                              r"\(OverflowError"),
    ({"graph": {0: [1.0]}}, r"ind\.cora\.graph does not hold adjacency lists .*'float'"),
    ({"graph": {"0": [1]}}, r"ind\.cora\.graph does not hold adjacency lists .*'str'"),
    ({"graph": {0: "1"}}, r"ind\.cora\.graph does not hold adjacency lists .*'str'"),
    # matrices of something else than numbers, a sparse matrix with indices past its shape
    ({"y": np.array([["a", "b"], ["b", "a"]])},
     r"ind\.cora\.y cannot be read .*expected a matrix of numbers, got dtype <U1"),
    ({"ally": np.array([[[1], 0]] * 502, dtype=object)},
     r"ind\.cora\.ally cannot be read .*expected a matrix of numbers, got dtype object"),
    ({"tx": broken_csr()}, r"ind\.cora\.tx cannot be read .*ValueError: indices must be < 3"),
    ({"y": np.array([1.0, 0.0])}, r"ind\.cora\.y cannot be read .*expected a 2-D matrix"),
    ({"graph": [[1], [0]]}, r"ind\.cora\.graph cannot be read .*expected a dict"),
    ({"graph": {0: ["a"]}}, r"ind\.cora\.graph does not hold adjacency lists of node ids"),
])
def test_tiny_planetoid_that_does_not_fit_together_is_refused(tmp_path, monkeypatch, offline,
                                                              override, message):
    write_tiny_planetoid(tmp_path, monkeypatch, **override)
    with pytest.raises(CorruptFileError, match=message):
        load_planetoid("Cora", tmp_path)
    if set(override) <= {"x", "tx", "allx"}:  # the structure files fit: they load without them
        assert load_planetoid("Cora", tmp_path, structure_only=True).num_nodes == 504
    else:  # checked before any array is built, with or without the features
        with pytest.raises(CorruptFileError, match=message):
            load_planetoid("Cora", tmp_path, structure_only=True)


def test_tiny_planetoid_with_consecutive_test_nodes_past_the_graph_loads(tmp_path, monkeypatch,
                                                                         offline):
    # Only skipped test ids (CiteSeer's 15) must be nodes of the graph; a listed test node may
    # have no edges and be missing from the dict.
    write_tiny_planetoid(tmp_path, monkeypatch, tx=np.ones((3, 3)), ty=np.eye(2)[[0, 1, 1]],
                         **{"test.index": "503\n502\n504\n"})
    data = load_planetoid("Cora", tmp_path)
    assert data.num_nodes == 505 and data.y[502:].tolist() == [1, 0, 1]
    assert data.test_mask[502:].all() and int(data.test_mask.sum()) == 3


def test_graphattn_data_expands_the_home_directory(monkeypatch):
    monkeypatch.setenv("GRAPHATTN_DATA", "~/graphattn-data")
    assert ds.default_root() == Path.home() / "graphattn-data"
