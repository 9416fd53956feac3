"""atoll.train.data: the stdlib corpus, token shards on fsspec, learner shards and the cursor."""

from __future__ import annotations

import json
import pickle
import resource
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.train.corpus import FILE_SEPARATOR, _is_val
from atoll.train.data import (
    CURSOR_FORMAT,
    BatchStream,
    DataError,
    decode_bytes,
    encode_bytes,
    evaluate,
    open_tokens,
    stdlib_corpus,
    stdlib_path,
    text_corpus,
    token_corpus,
    write_tokens,
)
from atoll.train.model import build_model, micro


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def corpus(cache: Path):
    return stdlib_corpus(max_corpus_mb=1.0, val_fraction=0.1, cache_dir=cache)


@pytest.fixture
def mem() -> Iterator[MemoryFileSystem]:
    # The memory filesystem is process-global: remove only what this test created.
    fs = fsspec.filesystem("memory")
    before, dirs = set(fs.store), list(fs.pseudo_dirs)
    yield fs
    for key in set(fs.store) - before:
        del fs.store[key]
    fs.pseudo_dirs[:] = dirs


def tokens_of(data, start=0, count=None) -> np.ndarray:
    return data.read(start, len(data) - start if count is None else count)


# -- the default corpus --------------------------------------------------------------------


def test_stdlib_corpus_is_split_by_file_deterministically(corpus, cache: Path, tmp_path: Path) -> None:
    meta = corpus.meta
    train_files, val_files = meta["files"]["train"], meta["files"]["val"]
    assert train_files and val_files and not set(train_files) & set(val_files)
    assert all(_is_val(f, 0.1) for f in val_files) and not any(_is_val(f, 0.1) for f in train_files)
    assert corpus.vocab_size == 256 and corpus.train.vocab_size == 256
    assert 1_000_000 <= meta["train_tokens"] + meta["val_tokens"] < 1_000_000 + 2_000_000
    # The token file is exactly the files' bytes, each followed by the separator.
    root = stdlib_path()
    expected = b"".join((root / f).read_bytes() + bytes([FILE_SEPARATOR]) for f in val_files)
    assert tokens_of(corpus.val).astype(np.uint8).tobytes() == expected
    # Same inputs, another cache folder: identical splits, byte for byte.
    again = stdlib_corpus(max_corpus_mb=1.0, val_fraction=0.1, cache_dir=tmp_path)
    assert again.meta["files"] == meta["files"]
    assert np.array_equal(tokens_of(again.train), tokens_of(corpus.train))
    # Second call hits the cache (no new folder, same files).
    before = sorted(p.name for p in cache.iterdir())
    stdlib_corpus(max_corpus_mb=1.0, val_fraction=0.1, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == before
    assert "site-packages" not in "".join(train_files + val_files)


def test_stdlib_corpus_walks_the_stdlib_once_per_process_and_cache_folder(tmp_path: Path, monkeypatch) -> None:
    from atoll.train import corpus as corpus_module

    walks: list[Path] = []
    real = corpus_module._text_files
    monkeypatch.setattr(corpus_module, "_text_files", lambda root, *a: walks.append(root) or real(root, *a))
    first = stdlib_corpus(max_corpus_mb=0.2, val_fraction=0.1, cache_dir=tmp_path / "a")
    second = stdlib_corpus(max_corpus_mb=0.2, val_fraction=0.1, cache_dir=tmp_path / "a")
    assert walks == [stdlib_path()]
    assert second.meta == first.meta and second.meta is not first.meta  # a caller's edit stays its own
    assert np.array_equal(tokens_of(second.train), tokens_of(first.train))
    # Another cache folder, or the cached token files gone: built again, the same bytes.
    stdlib_corpus(max_corpus_mb=0.2, val_fraction=0.1, cache_dir=tmp_path / "b")
    assert len(walks) == 2
    for f in (tmp_path / "a").rglob("*"):
        if f.is_file():
            f.unlink()
    third = stdlib_corpus(max_corpus_mb=0.2, val_fraction=0.1, cache_dir=tmp_path / "a")
    assert len(walks) == 3 and np.array_equal(tokens_of(third.train), tokens_of(first.train))
    # Another source folder is walked every time (its files may change between calls).
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text(f"x = {i}\n")
    stdlib_corpus(source_dir=src, val_fraction=0.3, cache_dir=tmp_path / "c")
    stdlib_corpus(source_dir=src, val_fraction=0.3, cache_dir=tmp_path / "c")
    assert walks[3:] == [src, src]


def test_text_corpus_split_is_stable_when_files_are_added(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(40):
        (src / "pkg" / f"m{i:02d}.py").write_text(f"x = {i}\n" * 5)
    a = text_corpus(src, val_fraction=0.3, cache_dir=tmp_path / "c1")
    (src / "pkg" / "new.py").write_text("y = 1\n")
    b = text_corpus(src, val_fraction=0.3, cache_dir=tmp_path / "c1")
    assert set(a.meta["files"]["val"]) <= set(b.meta["files"]["val"])
    assert set(a.meta["files"]["train"]) <= set(b.meta["files"]["train"])
    assert len(b.meta["files"]["train"]) + len(b.meta["files"]["val"]) == 41


def test_corpus_errors_name_the_knob(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="source_dir"):
        stdlib_corpus(source_dir=tmp_path / "nope", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="pattern"):
        text_corpus(tmp_path / "empty", cache_dir=tmp_path)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("a = 1\n")
    with pytest.raises(DataError, match="max_corpus_mb|val_fraction"):
        text_corpus(tmp_path / "one", val_fraction=0.01, cache_dir=tmp_path)  # one file: a split is empty
    with pytest.raises(DataError, match="val_fraction"):
        stdlib_corpus(val_fraction=0.0, cache_dir=tmp_path)
    with pytest.raises(DataError, match="max_corpus_mb"):
        stdlib_corpus(max_corpus_mb=0, cache_dir=tmp_path)


def test_byte_codec_roundtrip() -> None:
    text = "def f(x):\n    return 'é'\n"
    assert decode_bytes(encode_bytes(text)) == text
    assert decode_bytes(torch.tensor([104, 105])) == "hi"


# -- token files on fsspec ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("where", ["memory", "local"])
def test_token_files_read_back(dtype: str, where: str, mem, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    high = 50257 if dtype == "uint16" else 100_000
    arr = rng.integers(0, high, size=5000)
    url = "memory://data/train.bin" if where == "memory" else str(tmp_path / "train.bin")
    write_tokens(url, arr, dtype=dtype, vocab_size=high)
    data = open_tokens(url)  # dtype and vocab from the sidecar
    assert len(data) == 5000 and data.vocab_size == high and data.files[0].dtype == dtype
    assert np.array_equal(data.read(1234, 100), arr[1234:1334])
    w = data.read_windows([0, 4000, 17], 65)
    assert np.array_equal(w[1], arr[4000:4065]) and w.dtype == np.int64
    # Explicit dtype without a sidecar works too; and the data survives pickling.
    write_tokens(url.replace("train", "raw"), arr, dtype=dtype, sidecar=False)
    raw = pickle.loads(pickle.dumps(open_tokens(url.replace("train", "raw"), dtype=dtype)))
    assert np.array_equal(raw.read(4990, 10), arr[4990:])


def test_remote_reads_fetch_only_the_needed_ranges(mem, monkeypatch) -> None:
    n = 2_000_000  # 8 MB of uint32
    arr = np.arange(n, dtype=np.uint32)
    write_tokens("memory://big/train.bin", arr, dtype="uint32")
    read_bytes = []
    real_cat_file = MemoryFileSystem.cat_file
    real_open = MemoryFileSystem.open

    def counting_cat_file(self, path, start=None, end=None, **kw):
        out = real_cat_file(self, path, start, end, **kw)
        read_bytes.append(len(out))
        return out

    def guarded_open(self, path, mode="rb", **kw):
        assert not path.endswith(".bin") or "w" in mode, "token file opened for a full read"
        return real_open(self, path, mode, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", counting_cat_file)
    monkeypatch.setattr(MemoryFileSystem, "open", guarded_open)
    data = open_tokens("memory://big/train.bin")
    stream = BatchStream(data, context_tokens=128, learner_index=2, num_learners=4)
    x, y = stream.next_batch(8)
    assert sum(read_bytes) == 8 * 129 * 4  # exactly the 8 windows, nothing else
    # x/y are the tokens at those offsets (arange: the token is its own index).
    assert torch.equal(y[:, :-1], x[:, 1:])
    # Learner 2 of 4 owns windows 2, 6, 10, ... (interleaved shards).
    assert all(int(v) % 128 == 0 and (int(v) // 128) % 4 == 2 for v in x[:, 0])
    assert torch.equal(x[:, 1] - x[:, 0], torch.ones(8, dtype=torch.int64))


def test_local_reads_do_not_load_a_huge_sparse_file(tmp_path: Path) -> None:
    path = tmp_path / "huge.bin"
    size = 8 << 30  # 8 GiB, sparse: costs no disk; reading it all would take GBs of RAM
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size - 4 * 1000)
        f.write(np.arange(1000, dtype=np.uint32).tobytes())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = open_tokens(str(path), dtype="uint32")
    assert len(data) == size // 4
    assert np.array_equal(data.read(len(data) - 1000, 1000), np.arange(1000))
    stream = BatchStream(data, context_tokens=256, learner_index=3, num_learners=4, seed=1)
    x, y = stream.next_batch(32)
    assert x.shape == (32, 256)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kb < 200_000


def test_glob_joins_files_and_windows_straddle_them(mem) -> None:
    parts = [np.arange(0, 300), np.arange(300, 350), np.arange(350, 1000)]
    for i, p in enumerate(parts):
        write_tokens(f"memory://shards/train_{i:03d}.bin", p, dtype="uint16")
    data = open_tokens("memory://shards/train_*.bin")
    assert len(data) == 1000 and len(data.files) == 3
    assert np.array_equal(data.read(280, 100), np.arange(280, 380))  # crosses two boundaries
    assert np.array_equal(data.view(290, 400).read(0, 110), np.arange(290, 400))


def test_token_file_errors_name_the_knob(mem, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="url"):
        open_tokens("memory://nowhere/train.bin", dtype="uint16")
    with pytest.raises(FileNotFoundError, match="matched nothing"):
        open_tokens("memory://nowhere/*.bin", dtype="uint16")
    write_tokens("memory://d/raw.bin", np.arange(11), dtype="uint16", sidecar=False)
    with pytest.raises(DataError, match="dtype="):
        open_tokens("memory://d/raw.bin")  # no dtype and no sidecar
    with pytest.raises(DataError, match="dtype="):
        open_tokens("memory://d/raw.bin", dtype="uint32")  # 22 bytes is not whole uint32 tokens
    with pytest.raises(DataError, match="dtype="):
        open_tokens("memory://d/raw.bin", dtype="int8")
    write_tokens("memory://d/t.bin", np.arange(12), dtype="uint16")
    with pytest.raises(DataError, match="contradicts"):
        open_tokens("memory://d/t.bin", dtype="uint32")
    write_tokens("memory://d/v.bin", np.arange(300), dtype="uint16", vocab_size=256, sidecar=False)
    mem.pipe_file("/d/v.bin.json", json.dumps({"dtype": "uint16", "vocab_size": 256}).encode())
    with pytest.raises(DataError, match="vocab_size"):
        open_tokens("memory://d/v.bin").read(0, 300)
    with pytest.raises(DataError, match="vocab_size"):
        token_corpus("memory://d/raw.bin", "memory://d/raw.bin", dtype="uint16")


def test_token_corpus_of_user_shards(mem) -> None:
    write_tokens("memory://owt/train.bin", np.arange(4000) % 50257, dtype="uint16", vocab_size=50257)
    write_tokens("memory://owt/val.bin", np.arange(500), dtype="uint16", vocab_size=50257)
    c = token_corpus("memory://owt/train.bin", "memory://owt/val.bin")
    assert c.vocab_size == 50257 and len(c.train) == 4000 and len(c.val) == 500


# -- learner shards and the cursor ---------------------------------------------------------


def windows_seen(stream: BatchStream, batches: int, batch_size: int) -> list[int]:
    """Shard-relative start offsets of the windows served, read from the tokens themselves."""
    out = []
    for _ in range(batches):
        x, _ = stream.next_batch(batch_size)
        out += x[:, 0].tolist()
    return out


@pytest.fixture
def counting(mem):
    # Token value == its index, so every window reveals where it came from.
    write_tokens("memory://c/train.bin", np.arange(3 * 23 * 10 + 7), dtype="uint32")
    return open_tokens("memory://c/train.bin")


def test_interleaved_learner_shards_are_disjoint_and_cover_the_corpus(counting) -> None:
    # The default: learner i owns windows i, i + M, i + 2M, ... of the whole corpus, so every
    # shard samples the whole corpus even when it is ordered (files sorted by path).
    total = (len(counting) - 1) // 10  # 69 windows of 10 (+1) tokens
    owned = []
    for i in range(3):
        s = BatchStream(counting, context_tokens=10, learner_index=i, num_learners=3, seed=5)
        assert s.num_windows == 23
        seen = windows_seen(s, s.num_windows, 1)  # one full epoch
        assert seen == windows_seen(BatchStream(counting, context_tokens=10, learner_index=i, num_learners=3,
                                                seed=5), s.num_windows, 1)
        assert sorted(seen) == [(i + 3 * k) * 10 for k in range(23)]
        owned += seen
    assert sorted(owned) == [w * 10 for w in range(total)]
    # Uneven split: 7 windows over 3 learners -> 3, 2, 2.
    write_tokens("memory://c/seven.bin", np.arange(71), dtype="uint32")
    seven = open_tokens("memory://c/seven.bin")
    assert [BatchStream(seven, context_tokens=10, learner_index=i, num_learners=3).num_windows
            for i in range(3)] == [3, 2, 2]
    # A cursor saved by a contiguous-shard stream (or by atoll before interleaving) is refused.
    old = BatchStream(counting, context_tokens=10, learner_index=1, num_learners=3, interleave=False).state_dict()
    del old["interleave"]
    with pytest.raises(DataError, match="interleave"):
        BatchStream(counting, context_tokens=10, learner_index=1, num_learners=3).load_state_dict(old)
    BatchStream(counting, context_tokens=10, learner_index=1, num_learners=3, interleave=False).load_state_dict(old)


def test_contiguous_learner_shards_are_disjoint_and_deterministic(counting) -> None:
    spans = []
    for i in range(3):
        s = BatchStream(counting, context_tokens=10, learner_index=i, num_learners=3, seed=5, interleave=False)
        seen = windows_seen(s, 23, 1)  # one full epoch
        twin = BatchStream(counting, context_tokens=10, learner_index=i, num_learners=3, seed=5, interleave=False)
        again = windows_seen(twin, 23, 1)
        assert seen == again
        lo, hi = s.shard.start, s.shard.stop
        assert all(lo <= v and v + 11 <= hi for v in seen)
        spans.append((lo, hi))
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0]
    assert spans[0][0] == 0 and spans[2][1] == len(counting)


@pytest.mark.parametrize("num_windows", [1, 2, 7, 16, 23, 97])
def test_an_epoch_visits_every_window_once(mem, num_windows: int) -> None:
    write_tokens("memory://e/t.bin", np.arange(num_windows * 4 + 1), dtype="uint32")
    s = BatchStream(open_tokens("memory://e/t.bin"), context_tokens=4, seed=3)
    assert s.num_windows == num_windows
    first = windows_seen(s, num_windows, 1)
    second = windows_seen(s, num_windows, 1)
    assert sorted(first) == sorted(second) == [4 * w for w in range(num_windows)]
    if num_windows > 3:
        assert first != sorted(first) and first != second  # shuffled, differently each epoch
    plain = BatchStream(open_tokens("memory://e/t.bin"), context_tokens=4, shuffle=False)
    assert windows_seen(plain, num_windows, 1) == [4 * w for w in range(num_windows)]


def test_cursor_restore_gives_exactly_the_next_batch_across_epochs(counting) -> None:
    def fresh() -> BatchStream:
        return BatchStream(counting, context_tokens=10, learner_index=1, num_learners=3, seed=9)

    ref = fresh()
    assert ref.num_windows == 23
    ref_batches = [ref.next_batch(5) for _ in range(12)]  # 60 windows: wraps two epochs
    s = fresh()
    for _ in range(4):
        s.next_batch(5)
    cursor = json.loads(json.dumps(s.state_dict()))  # travels as JSON with the learner state
    assert cursor["format"] == CURSOR_FORMAT and cursor["position"] == 20 and cursor["epoch"] == 0
    back = fresh()
    back.load_state_dict(cursor)
    for k in range(4, 12):
        x, y = back.next_batch(5)
        assert torch.equal(x, ref_batches[k][0]) and torch.equal(y, ref_batches[k][1])
    assert back.state_dict()["epoch"] == 2
    # The pure form agrees and does not move anything.
    (x, _), nxt = fresh().batch_at(cursor, 5)
    assert torch.equal(x, ref_batches[4][0]) and nxt["position"] == 2 and nxt["epoch"] == 1


def test_changing_batch_size_neither_repeats_nor_skips(counting) -> None:
    a = BatchStream(counting, context_tokens=10, seed=2, learner_index=0, num_learners=3)
    b = BatchStream(counting, context_tokens=10, seed=2, learner_index=0, num_learners=3)
    assert windows_seen(a, 1, 12) == windows_seen(b, 4, 3)
    b.load_state_dict(a.state_dict())
    assert windows_seen(a, 3, 2) == windows_seen(b, 2, 3)


def test_batches_are_shifted_pairs(corpus) -> None:
    s = BatchStream(corpus.train, context_tokens=64, seed=0)
    x, y = s.next_batch(4)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert s.tokens_served == 4 * 64


def test_cursor_mismatch_and_small_shards_are_refused(counting) -> None:
    s = BatchStream(counting, context_tokens=10, learner_index=0, num_learners=3)
    cursor = s.state_dict()
    with pytest.raises(DataError, match="num_learners"):
        BatchStream(counting, context_tokens=10, learner_index=0, num_learners=2).load_state_dict(cursor)
    with pytest.raises(DataError, match="context_tokens"):
        BatchStream(counting, context_tokens=11, learner_index=0, num_learners=3).load_state_dict(cursor)
    with pytest.raises(DataError, match="learner_index"):
        BatchStream(counting, context_tokens=10, learner_index=1, num_learners=3).load_state_dict(cursor)
    with pytest.raises(DataError, match="format"):
        s.load_state_dict({"epoch": 0, "position": 0})
    with pytest.raises(DataError, match="batch_size"):
        s.next_batch(24)  # the shard has 23 windows
    with pytest.raises(DataError, match="context_tokens"):
        BatchStream(counting, context_tokens=500, learner_index=1, num_learners=3)  # 1 window, learner 0's
    with pytest.raises(DataError, match="context_tokens"):
        BatchStream(counting, context_tokens=500, learner_index=0, num_learners=3, interleave=False)
    with pytest.raises(DataError, match="learner_index"):
        BatchStream(counting, context_tokens=10, learner_index=3, num_learners=3)


# -- validation --------------------------------------------------------------------------


def test_evaluate_is_deterministic_and_restores_mode(corpus) -> None:
    model = build_model(micro(dropout=0.1), seed=0)
    model.train()
    a = evaluate(model, corpus.val, batches=2, batch_size=8)
    b = evaluate(model, corpus.val, batches=2, batch_size=8)
    assert a == b and 5.0 < a < 6.0 and model.training
    tiny_val = corpus.val.view(0, 30)
    with pytest.raises(DataError, match="context_tokens"):
        evaluate(model, tiny_val)
    assert evaluate(model, corpus.val.view(0, 65 * 3), batches=4, batch_size=8) > 0  # uses what exists


@settings(max_examples=60, deadline=None)
@given(
    num_windows=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_cursor_chain_equals_one_long_read(num_windows: int, seed: int, sizes: list[int]) -> None:
    # Property: however the stream is cut into batches (sizes up to the shard's window count),
    # following cursors yields exactly the windows of one long read, and every epoch is a
    # permutation of the shard's windows.
    url = f"memory://prop/{num_windows}.bin"
    write_tokens(url, np.arange(num_windows * 2 + 1), dtype="uint32")
    s = BatchStream(open_tokens(url), context_tokens=2, seed=seed)
    sizes = [min(k, num_windows) for k in sizes]
    cursor, chained = s.state_dict(), []
    for k in sizes:
        chained += s.window_indices(cursor, k)
        (x, _), cursor = s.batch_at(json.loads(json.dumps(cursor)), k)
        assert (x[:, 0] // 2).tolist() == [w for _, w in chained[-k:]]
    assert chained == s.window_indices(s.state_dict(), sum(sizes))
    assert cursor["epoch"] * num_windows + cursor["position"] == sum(sizes)
    epoch0 = s.window_indices(s.state_dict(), num_windows)
    assert sorted(w for _, w in epoch0) == list(range(num_windows))
