"""The Planetoid citation datasets (Cora, CiteSeer, PubMed), verified by SHA-256 before loading.

The raw files are the ones published with Planetoid (Yang, Cohen & Salakhutdinov, ICML 2016) in
https://github.com/kimiyoung/planetoid, folder ``data/`` (MIT licence), in the layout that
``torch_geometric.datasets.Planetoid`` also uses: ``<root>/<Name>/raw/ind.<name>.<part>``.
Missing files are downloaded from there; every file, downloaded or found, is checked against the
SHA-256 sum in :data:`SHA256` before it is read, and the pickles are read by an unpickler that
only builds numpy arrays, scipy CSR matrices, lists and dicts.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import importlib
import operator
import os
import pickle
import secrets
from collections.abc import Callable
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

import numpy as np
import scipy.sparse
import torch
from torch import Tensor
from torch_geometric.data import Data
from tqdm.auto import tqdm

from graphattn._checks import check_flag

PLANETOID_URL = "https://github.com/kimiyoung/planetoid/raw/master/data"
"""Where missing raw files are downloaded from (the URL ``torch_geometric`` uses)."""

PLANETOID_SOURCE = "https://github.com/kimiyoung/planetoid (folder data/, MIT licence)"

NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
"""The known datasets, each lower-case name with its folder name."""

PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
"""The raw files of a dataset, ``ind.<name>.<part>`` for each part."""
FEATURE_PARTS = ("x", "tx", "allx")
STRUCTURE_PARTS = tuple(p for p in PARTS if p not in FEATURE_PARTS)

SHA256 = {
    "ind.cora.x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
    "ind.cora.tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
    "ind.cora.allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
    "ind.cora.y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
    "ind.cora.ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
    "ind.cora.ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
    "ind.cora.graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
    "ind.cora.test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
    "ind.citeseer.x": "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6",
    "ind.citeseer.tx": "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21",
    "ind.citeseer.allx": "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668",
    "ind.citeseer.y": "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924",
    "ind.citeseer.ty": "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce",
    "ind.citeseer.ally": "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95",
    "ind.citeseer.graph": "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7",
    "ind.citeseer.test.index": "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4",
    "ind.pubmed.x": "fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33",
    "ind.pubmed.tx": "4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d",
    "ind.pubmed.allx": "508e538e2abdccdd54c4d3e9f49d638b4af7107d85845f66ddea5a5152658b7e",
    "ind.pubmed.y": "e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3",
    "ind.pubmed.ty": "ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd",
    "ind.pubmed.ally": "0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e",
    "ind.pubmed.graph": "5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9",
    "ind.pubmed.test.index": "b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5",
}
"""SHA-256 of every published raw file (the same list as ``datasets/SHA256SUMS``)."""

NUM_VAL = 500


class ChecksumError(ValueError):
    """A raw file's SHA-256 differs from the published one; the file is not loaded."""


class CorruptFileError(ValueError):
    """A raw file has the right name but cannot be parsed as the Planetoid format."""


class MissingFilesError(FileNotFoundError):
    """Raw files are missing and could not be downloaded."""


def default_root() -> Path:
    """The data root used when ``load_planetoid`` gets ``root=None``.

    In order: the environment variable ``GRAPHATTN_DATA``; ``datasets/`` at the repository root
    when graphattn runs from a source checkout (``pip install -e .``); else
    ``$XDG_CACHE_HOME/graphattn`` (``~/.cache/graphattn``) for an installed wheel.
    """
    env = os.environ.get("GRAPHATTN_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parent.parent
    if (repo / "datasets" / "SHA256SUMS").is_file():
        return repo / "datasets"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "graphattn"


def canonical_name(name: str) -> str:
    """``"cora"`` / ``"CORA"`` -> ``"Cora"``; raises for a name that is not a Planetoid dataset."""
    if not isinstance(name, str) or name.lower() not in NAMES:
        raise ValueError(f"name must be one of {list(NAMES.values())} (any case), got {name!r}")
    return NAMES[name.lower()]


def raw_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<Name>/raw``, the folder that holds the raw files of dataset ``name``."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (a str or os.PathLike) or None, got {root!r} "
                        f"(a {type(root).__name__})")
    base = Path(root).expanduser() if root is not None else default_root()
    return base / canonical_name(name) / "raw"


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, path: str | os.PathLike, sha256: str, *, progress: bool = True,
                  timeout: float = 60.0) -> None:
    """Download ``url`` to ``path``; the file appears there only once complete and verified.

    The bytes go to a temporary file in the same folder, hashed on the way; it is renamed to
    ``path`` when its SHA-256 equals ``sha256`` and deleted otherwise. A response that ends
    before its ``Content-Length`` is a failed download, not a checksum mismatch.

    Args:
        url (str): source.
        path (str or os.PathLike): destination file.
        sha256 (str): expected hex SHA-256.
        progress (bool, optional): show a tqdm progress bar. (default: ``True``)
        timeout (float, optional): socket timeout in seconds. (default: ``60.0``)

    Raises:
        ChecksumError: the downloaded bytes have another SHA-256 (nothing is written to ``path``).
        urllib.error.URLError, OSError: the download failed or ended early.
    """
    path = Path(path)
    created = [folder for folder in path.parents if not folder.exists()]  # innermost first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _download_to(url, path, sha256, progress, timeout)
    except BaseException:  # a failed download leaves no empty folders behind (a mistyped root)
        for folder in created:
            try:
                folder.rmdir()  # only while empty
            except OSError:
                break
        raise


def _download_to(url: str, path: Path, sha256: str, progress: bool, timeout: float) -> None:
    """:func:`download_file` into the existing folder of ``path``."""
    # Not tempfile.mkstemp: its mode 0600 would stay on the renamed file, unreadable to others in
    # a shared data root. open(..., "x") creates the file with the umask's mode, never reusing one.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.part")
    out = open(tmp, "xb")
    try:
        digest, received = hashlib.sha256(), 0
        try:
            with out, urlopen(url, timeout=timeout) as response:
                size = response.headers.get("Content-Length") if response.headers else None
                with tqdm(total=int(size) if size else None, unit="B", unit_scale=True,
                          desc=path.name, disable=not progress, leave=False) as bar:
                    for chunk in iter(lambda: response.read(1 << 16), b""):
                        out.write(chunk)
                        digest.update(chunk)
                        received += len(chunk)
                        bar.update(len(chunk))
        except http.client.HTTPException as err:  # IncompleteRead, BadStatusLine: not OSErrors
            raise OSError(f"{url}: {type(err).__name__}: {err}") from err
        if size and received != int(size):
            raise OSError(f"{url} ended after {received} of {size} bytes")
        actual = digest.hexdigest()
        if actual != sha256:
            raise ChecksumError(f"downloaded {url} has SHA-256 {actual}, expected {sha256}; "
                                f"it was discarded and {path} was not written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _manual_help(name: str, folder: Path, files: list[str]) -> str:
    urls = "\n".join(f"  {PLANETOID_URL}/{f}" for f in files)
    return (f"They come from {PLANETOID_SOURCE}. To install them by hand, download\n{urls}\n"
            f"and put them into {folder}/ (or pass root=... / set GRAPHATTN_DATA to a folder "
            f"that holds {name}/raw/).")


def ensure_raw_files(name: str, root: str | os.PathLike | None = None,
                     parts: tuple[str, ...] = PARTS, *, download: bool = True,
                     progress: bool = True) -> dict[str, Path]:
    """Make sure the raw files of ``name`` are present and verified; download the missing ones.

    Args:
        name (str): ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"`` (any case).
        root (str or os.PathLike, optional): data root. (default: :func:`default_root`)
        parts (tuple of str, optional): which of :data:`PARTS` are needed. (default: all)
        download (bool, optional): fetch missing files from :data:`PLANETOID_URL`.
            (default: ``True``)
        progress (bool, optional): progress bar while downloading. (default: ``True``)

    Returns:
        dict: part -> path of its verified file.

    Raises:
        MissingFilesError: files are missing and could not be downloaded; the message names them,
            their source and the folder to put them in.
        ChecksumError: a file's SHA-256 differs from :data:`SHA256`.
    """
    name = canonical_name(name)
    download = check_flag(download, "download")
    progress = check_flag(progress, "progress")
    if (isinstance(parts, str) or not isinstance(parts, (tuple, list))
            or not all(part in PARTS for part in parts)):
        raise ValueError(f"parts must be a sequence of names from {PARTS}, got {parts!r}")
    folder = raw_dir(name, root)
    paths = {part: folder / f"ind.{name.lower()}.{part}" for part in parts}
    missing = [part for part, p in paths.items() if not p.is_file()]
    failure = "download=False"
    for part in list(missing) if download else []:
        fname = paths[part].name
        try:
            download_file(f"{PLANETOID_URL}/{fname}", paths[part], SHA256[fname],
                          progress=progress)
        except (URLError, OSError) as err:
            failure = f"download failed: {err}"
            break
        missing.remove(part)
    if missing:
        files = [paths[p].name for p in missing]
        hint = ""
        if all(p in FEATURE_PARTS for p in missing):
            where = "" if root is None else f", root={str(root)!r}"
            hint = (f"\nWithout them, load_planetoid({name!r}{where}, structure_only=True) "
                    f"loads the graph, labels and split (no features).")
        raise MissingFilesError(
            f"{name}: {len(files)} raw file(s) missing from {folder} ({failure}): "
            f"{', '.join(files)}.\n" + _manual_help(name, folder, files) + hint)
    for path in paths.values():
        expected, actual = SHA256[path.name], file_sha256(path)
        if actual != expected:
            raise ChecksumError(
                f"{path} has SHA-256 {actual}, expected {expected} (the published file); "
                f"it was not loaded. Delete it to download it again.")
    return paths


def _numpy_reconstruct():
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("numpy's array reconstructor was not found")


_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("scipy.sparse.csr", "csr_matrix"): lambda: scipy.sparse.csr_matrix,
    ("collections", "defaultdict"): lambda: collections.defaultdict,
    ("__builtin__", "list"): lambda: list,
    ("builtins", "list"): lambda: list,
}


class _PlanetoidUnpickler(pickle.Unpickler):
    """Builds only what the Planetoid files contain: arrays, CSR matrices, lists, dicts."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to build {module}.{name}")
        return _PICKLE_GLOBALS[module, name]()


def _read_part(path: Path, part: str):
    """Parse one verified raw file; any failure becomes a :class:`CorruptFileError`."""
    def corrupt(reason: str) -> CorruptFileError:
        return CorruptFileError(f"{path} cannot be read as a Planetoid file ({reason}); it is "
                                f"damaged or not the published file. Delete it to download it "
                                f"again.")

    try:
        if part == "test.index":
            return np.array([int(line) for line in path.read_text().split()], dtype=np.int64)
        with open(path, "rb") as f:
            obj = _PlanetoidUnpickler(f, encoding="latin1").load()
        if scipy.sparse.issparse(obj):
            obj.check_format(full_check=True)  # toarray trusts indices and indptr blindly
            obj = obj.toarray()
    except Exception as err:  # every parse failure means a damaged file
        raise corrupt(f"{type(err).__name__}: {err}") from err
    if part == "graph":
        if not isinstance(obj, dict):
            raise corrupt(f"expected a dict of adjacency lists, got {type(obj).__name__}")
        return obj
    if not isinstance(obj, np.ndarray) or obj.ndim != 2:
        raise corrupt(f"expected a 2-D matrix, got {type(obj).__name__}")
    if obj.dtype.kind not in "biuf":
        raise corrupt(f"expected a matrix of numbers, got dtype {obj.dtype}")
    return obj


def _adjacency(graph: dict, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The graph file's dict ``{j: [i, ...]}`` as int64 arrays: its keys ``[K]``, and the sources
    ``j`` and targets ``i`` ``[E]`` of its listed edges."""
    try:
        keys = np.fromiter((operator.index(j) for j in graph), dtype=np.int64, count=len(graph))
        src = np.fromiter((operator.index(j) for j, nbrs in graph.items() for _ in nbrs),
                          dtype=np.int64)
        dst = np.fromiter((operator.index(i) for nbrs in graph.values() for i in nbrs),
                          dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:  # a str or float id, ids past int64
        raise CorruptFileError(f"{path} does not hold adjacency lists of node ids "
                               f"({type(err).__name__}: {err})") from err
    return keys, src, dst


def _check_fit(name: str, parts: dict, folder: Path, graph_ids: np.ndarray) -> None:
    """Raise a :class:`CorruptFileError` naming the files and their sizes where the parts of
    ``name`` do not fit together (the checks of the published files' layout, made before any
    array is built from them).

    The layout: ``ally`` (``[A, C]``) labels nodes ``0 .. A-1``, of which ``y`` (``[T, C]``)
    the first ``T`` training nodes and the next :data:`NUM_VAL` are validation nodes;
    ``test.index`` lists the ``R`` distinct test nodes, labelled by ``ty`` (``[R, C]``) row by
    row, the lowest being node ``A``; ``x``, ``allx``, ``tx`` (``[T, F]``, ``[A, F]``,
    ``[R, F]``) hold the features of the same rows. The ``N = A + span`` nodes are those of
    ``ally`` and the span of ``test.index``; the graph's ids (``graph_ids``: its keys and their
    neighbours) lie in ``[0, N)``. Ids that ``test.index`` skips (15 in CiteSeer, padded with
    zero rows) must lie below the graph's highest id: a skip beyond it, as a test index of
    ``10**11``, is damage, not a node.
    """
    file = {part: f"ind.{name.lower()}.{part}" for part in PARTS}

    def check(condition: bool, what: str) -> None:
        if not condition:
            raise CorruptFileError(f"{name}: the raw files in {folder} do not fit together: "
                                   f"{what}. Delete the damaged file(s) to download them again.")

    def sizes(which: tuple[str, ...], axis: int) -> str:
        first, *rest = which
        return ", ".join([f"{file[first]} has {parts[first].shape[axis]}"]
                         + [f"{file[p]} {parts[p].shape[axis]}" for p in rest])

    y, ty, ally, test_index = parts["y"], parts["ty"], parts["ally"], parts["test.index"]
    labels = ("y", "ty", "ally")
    check(len({parts[p].shape[1] for p in labels}) == 1,
          f"the label files disagree on the number of classes (columns): {sizes(labels, 1)}")
    check(y.shape[1] > 0, f"the label files have no columns (classes): {sizes(labels, 1)}")
    check(y.shape[0] + NUM_VAL <= ally.shape[0],
          f"{file['y']} has {y.shape[0]} rows (training nodes) but {file['ally']} only "
          f"{ally.shape[0]}, fewer than them and the {NUM_VAL} validation nodes after them")
    check(len(test_index) == ty.shape[0],
          f"{file['test.index']} lists {len(test_index)} nodes but {file['ty']} has "
          f"{ty.shape[0]} rows")
    check(len(test_index) > 0, f"{file['test.index']} lists no nodes")
    nodes, counts = np.unique(test_index, return_counts=True)  # sorted
    if nodes.size < test_index.size:
        twice = counts > 1
        check(False, f"{file['test.index']} lists {int(twice.sum())} node(s) more than once "
                     f"(node {int(nodes[twice][0])} {int(counts[twice][0])} times)")
    lo, hi = int(nodes[0]), int(nodes[-1])
    check(lo == ally.shape[0], f"{file['test.index']} starts at node {lo} but {file['ally']} "
          f"has {ally.shape[0]} rows: the test nodes start at node {ally.shape[0]}")
    if "allx" in parts:
        features = ("x", "tx", "allx")
        check(len({parts[p].shape[1] for p in features}) == 1,
              f"the feature files disagree on the number of features (columns): "
              f"{sizes(features, 1)}")
        for feature, label in (("x", "y"), ("allx", "ally"), ("tx", "ty")):
            check(parts[feature].shape[0] == parts[label].shape[0],
                  f"{file[feature]} has {parts[feature].shape[0]} rows but {file[label]} has "
                  f"{parts[label].shape[0]}")
    num_nodes = hi + 1  # the rows of ally, then the span of test.index
    low, high = (int(graph_ids.min()), int(graph_ids.max())) if graph_ids.size else (0, -1)
    check(low >= 0 and high < num_nodes,
          f"{file['graph']} has node ids outside [0, {num_nodes}) (from {low} to {high}), the "
          f"nodes of {file['ally']} and {file['test.index']}")
    skipped = hi - lo + 1 - len(test_index)
    check(skipped == 0 or hi <= high,
          f"{file['test.index']} skips {skipped} node ids up to node {hi}, past the last node "
          f"{high} of {file['graph']}: only nodes of the graph may be left out of the test files")


def _read_planetoid(name: str, paths: dict[str, Path], structure_only: bool) -> Data:
    """Assemble the graph as ``torch_geometric``'s ``read_planetoid_data`` does."""
    parts = {part: _read_part(path, part) for part, path in paths.items()}
    keys, src, dst = _adjacency(parts["graph"], paths["graph"])
    _check_fit(name, parts, paths["y"].parent, np.concatenate([keys, dst]))
    y, ty, ally, test_index = parts["y"], parts["ty"], parts["ally"], parts["test.index"]
    tx = parts.get("tx")
    lo, hi = int(test_index.min()), int(test_index.max())
    # CiteSeer's test indices skip nodes missing from tx / ty: pad them with zero rows.
    sorted_test = np.sort(test_index)
    span = hi - lo + 1
    ty_full = np.zeros((span, ty.shape[1]), dtype=ty.dtype)
    ty_full[sorted_test - lo] = ty
    # argmax gives intp, int32 on Windows before numpy 2: y is int64 everywhere
    labels = np.concatenate([ally, ty_full]).argmax(axis=1).astype(np.int64)
    labels[test_index] = labels[sorted_test]
    num_nodes = labels.shape[0]

    x = None
    if not structure_only:
        tx_full = np.zeros((span, tx.shape[1]), dtype=np.float32)
        tx_full[sorted_test - lo] = tx
        feats = np.concatenate([parts["allx"].astype(np.float32), tx_full])
        feats[test_index] = feats[sorted_test]
        x = torch.from_numpy(feats)
        x = x / x.sum(dim=1, keepdim=True).clamp_min(1.0e-12)  # row-normalised, zero rows stay 0

    edge_index = _undirected_simple(torch.from_numpy(src), torch.from_numpy(dst), num_nodes)

    def mask(index: Tensor) -> Tensor:
        m = torch.zeros(num_nodes, dtype=torch.bool)
        m[index] = True
        return m

    num_train = y.shape[0]
    return Data(x=x, edge_index=edge_index, y=torch.from_numpy(labels),
                train_mask=mask(torch.arange(num_train)),
                val_mask=mask(torch.arange(num_train, num_train + NUM_VAL)),
                test_mask=mask(torch.from_numpy(test_index)), num_nodes=num_nodes)


def _undirected_simple(src: Tensor, dst: Tensor, num_nodes: int) -> Tensor:
    """Both directions of every edge, without self-loops or duplicates, sorted by (dst, src)."""
    keep = src != dst
    src, dst = src[keep], dst[keep]
    key = torch.cat([dst * num_nodes + src, src * num_nodes + dst]).unique()  # sorted
    return torch.stack([key % num_nodes, key // num_nodes])  # (2, E): sources, targets


def load_planetoid(name: str, root: str | os.PathLike | None = None, *,
                   structure_only: bool = False, download: bool = True,
                   progress: bool = True,
                   transform: Callable[[Data], Data] | None = None) -> Data:
    r"""Load Cora, CiteSeer or PubMed with the standard public Planetoid split.

    Returns a :class:`torch_geometric.data.Data` with

    - ``x`` ``[N, F]`` float32 bag-of-words features, **row-normalised**
      (:math:`x_i \leftarrow x_i / \sum_f x_{if}`; all-zero rows stay zero), or ``None`` when
      ``structure_only``;
    - ``y`` ``[N]`` int64 class labels;
    - ``edge_index`` ``[2, E]`` int64, undirected (both directions of every edge), without
      self-loops or duplicates, sorted by target (then source);
    - ``train_mask``, ``val_mask``, ``test_mask`` ``[N]`` bool: the public split of Yang et al.
      (2016) as used by GCN and GAT: 20 labelled nodes per class for training, the next 500 nodes
      for validation, the 1000 listed test nodes for testing.

    As in ``torch_geometric.datasets.Planetoid``, the 15 CiteSeer nodes that the raw test files
    (``tx``, ``ty``) leave out get zero features and label 0 and belong to no split (they have
    edges; the graph's isolated nodes are others).

    ============  ======  ======  =====  =======
    dataset       N       E       F      classes
    ============  ======  ======  =====  =======
    Cora          2708    10556   1433   7
    CiteSeer      3327    9104    3703   6
    PubMed        19717   88648   500    3
    ============  ======  ======  =====  =======

    Files are looked up in ``<root>/<Name>/raw/ind.<name>.<part>``; missing ones are downloaded
    from :data:`PLANETOID_URL`, and every file is verified against :data:`SHA256` before it is
    read.

    Args:
        name (str): ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"`` (any case).
        root (str or os.PathLike, optional): data root. (default: ``$GRAPHATTN_DATA``, else
            ``datasets/`` of a source checkout, else ``~/.cache/graphattn``; see
            :func:`default_root`)
        structure_only (bool, optional): skip the feature files (``x``, ``tx``, ``allx``) and
            return ``x=None``: graph, labels and split only. (default: ``False``)
        download (bool, optional): download missing files. (default: ``True``)
        progress (bool, optional): show a progress bar while downloading. (default: ``True``)
        transform (callable, optional): applied to the loaded graph before it is returned, e.g.
            ``pe.AddLaplacianPE(8)`` or a ``torch_geometric.transforms`` object.
            (default: ``None``)

    Raises:
        ValueError: ``name`` is not one of the three datasets.
        TypeError: ``transform`` is not callable.
        MissingFilesError: files are missing and cannot be downloaded (the message says which,
            where they come from and where to put them by hand).
        ChecksumError: a file differs from the published one (it is never parsed).
        CorruptFileError: a file cannot be parsed, or the files do not fit together.

    Example:
        >>> data = load_planetoid("Cora")
        >>> data.x.shape, data.edge_index.shape, int(data.train_mask.sum())
        (torch.Size([2708, 1433]), torch.Size([2, 10556]), 140)
    """
    name = canonical_name(name)
    structure_only = check_flag(structure_only, "structure_only")
    download = check_flag(download, "download")
    progress = check_flag(progress, "progress")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable (Data -> Data), got "
                        f"{type(transform).__name__}")
    parts = STRUCTURE_PARTS if structure_only else PARTS
    paths = ensure_raw_files(name, root, parts, download=download, progress=progress)
    data = _read_planetoid(name, paths, structure_only)
    return data if transform is None else transform(data)
