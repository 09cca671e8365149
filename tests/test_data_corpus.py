import socket
import threading

import numpy as np
import pytest

from dynatrain.data import corpus
from dynatrain.data.corpus import cached_tokens, embedded_corpus, folder_corpus, load_bin, stdlib_files
from dynatrain.data.tokenizer import ByteTokenizer

CAP = 200_000


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the data pipeline tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_stdlib_files_sorted_capped_without_tests_or_site_packages():
    files = stdlib_files(CAP)
    rel = [f.relpath for f in files]
    assert rel == sorted(rel) and len(rel) == len(set(rel))
    assert all(f.relpath.endswith(".py") for f in files)
    for part in ("site-packages", "test", "tests", "idle_test"):
        assert not any(part in f.relpath.split("/")[:-1] for f in stdlib_files(None))
    total = sum(f.size for f in files)
    assert total >= CAP and total - files[-1].size < CAP


def test_embedded_corpus_is_deterministic_offline_and_cached(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("DYNATRAIN_CACHE", str(tmp_path / "env-cache"))
    tok = ByteTokenizer()
    first = embedded_corpus(tok, CAP)
    cached = sorted((tmp_path / "env-cache").glob("*.npy"))
    assert len(cached) == 1, "the cache dir must come from DYNATRAIN_CACHE"
    mtime = cached[0].stat().st_mtime_ns
    again = embedded_corpus(tok, CAP)
    assert cached[0].stat().st_mtime_ns == mtime, "a second build must read the cache"
    fresh = embedded_corpus(tok, CAP, cache=tmp_path / "other")
    assert np.array_equal(first, again) and np.array_equal(first, fresh)
    assert CAP - 5000 < len(first) <= CAP + len(stdlib_files(CAP))
    # One EOS after each document; the text between them is the files' source.
    assert int((first == tok.EOS).sum()) == len(stdlib_files(CAP))
    assert first[-1] == tok.EOS
    text = tok.decode(first)
    assert "def " in text and "import " in text
    first_doc = tok.decode(first[: int(np.argmax(first == tok.EOS))])
    assert first_doc == stdlib_files(CAP)[0].path.read_text(encoding="utf-8")


def test_cache_key_follows_cap_tokenizer_and_file_changes(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha")
    files = corpus.text_files(tmp_path / "d")
    key = corpus.cache_key(files, None, tok)
    assert corpus.cache_key(files, 10, tok) != key

    class Other(ByteTokenizer):
        @property
        def identity(self):
            return "other"

    assert corpus.cache_key(files, None, Other()) != key
    (tmp_path / "d" / "a.txt").write_text("alphabet")
    assert corpus.cache_key(corpus.text_files(tmp_path / "d"), None, tok) != key


def test_folder_corpus_reads_text_files_in_order(tmp_path):
    tok = ByteTokenizer()
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "b.txt").write_text("second")
    (data / "a.md").write_text("first")
    (data / "sub" / "c.py").write_bytes(b"third\xff")  # invalid UTF-8 is replaced, not fatal
    (data / "skip.bin").write_bytes(b"\x00\x01")
    (data / ".hidden.txt").write_text("hidden")
    tokens = folder_corpus(data, tok, cache=tmp_path / "cache")
    assert tok.decode(tokens) == "firstsecondthird\ufffd"
    eos = np.flatnonzero(tokens == tok.EOS).tolist()
    assert eos == [5, 12, 21] and len(tokens) == 22  # U+FFFD is 3 bytes


def test_folder_corpus_cache_is_rebuilt_when_a_file_changes(tmp_path):
    tok = ByteTokenizer()
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("one")
    assert tok.decode(folder_corpus(data, tok, cache=tmp_path / "c")) == "one"
    (data / "a.txt").write_text("three")
    assert tok.decode(folder_corpus(data, tok, cache=tmp_path / "c")) == "three"


def test_empty_or_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no text files"):
        folder_corpus(tmp_path, ByteTokenizer(), cache=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        folder_corpus(tmp_path / "nope", ByteTokenizer())


def test_concurrent_cache_builds_leave_one_whole_file(tmp_path):
    tok = ByteTokenizer()
    files = stdlib_files(50_000)
    results, errors = [], []

    def build():
        try:
            results.append(np.asarray(cached_tokens(files, 50_000, tok, cache=tmp_path)))
        except Exception as err:  # collected: an exception in a thread would not fail the test
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(np.array_equal(r, results[0]) for r in results)
    assert [p.suffix for p in tmp_path.iterdir()] == [".npy"], "no temporary file may be left behind"


def test_bin_uint16_and_uint32(tmp_path):
    ids16 = np.array([1, 2, 300, 65535], dtype=np.uint16)
    ids16.tofile(tmp_path / "t.bin")
    got = load_bin(tmp_path / "t.bin")
    assert got.dtype == np.uint16 and got.tolist() == ids16.tolist()

    ids32 = np.arange(70_000, 70_000 + 4096, dtype=np.uint32)
    ids32.tofile(tmp_path / "t.uint32.bin")
    assert load_bin(tmp_path / "t.uint32.bin").tolist() == ids32.tolist()
    ids32.tofile(tmp_path / "plain.bin")
    assert load_bin(tmp_path / "plain.bin", dtype="uint32").tolist() == ids32.tolist()
    with pytest.raises(ValueError, match="32-bit tokens read as uint16"):
        load_bin(tmp_path / "plain.bin")
    with pytest.raises(ValueError, match="uint16' or 'uint32"):
        load_bin(tmp_path / "plain.bin", dtype="int64")


def test_bin_vocab_check_and_size_check(tmp_path):
    np.array([5, 258, 400], dtype=np.uint16).tofile(tmp_path / "t.uint16.bin")
    assert load_bin(tmp_path / "t.uint16.bin", vocab_size=401).max() == 400
    with pytest.raises(ValueError, match="token id 400 .* 259 ids"):
        load_bin(tmp_path / "t.uint16.bin", vocab_size=259)
    (tmp_path / "odd.uint32.bin").write_bytes(b"\x01\x02\x03\x04\x05\x06")
    with pytest.raises(ValueError, match="whole non-zero number of uint32"):
        load_bin(tmp_path / "odd.uint32.bin")
    with pytest.raises(FileNotFoundError):
        load_bin(tmp_path / "missing.bin")


def test_unwritable_cache_still_gives_tokens(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache folder cannot be created where a file stands
    with pytest.warns(UserWarning, match="DYNATRAIN_CACHE"):
        tokens = cached_tokens(stdlib_files(10_000), 10_000, ByteTokenizer(), cache=blocker / "cache")
    assert len(tokens) > 0
