"""Host and disk tiers under the prefix cache (serving/kv_tiers.py): the stores on their
own, then the engine on a tiny model, whose greedy tokens must not change whichever tier
serves a prefix, and a Mooncake Store (a `mooncake_master` started here on 127.0.0.1)
shared by engines in two processes. The random-event invariants with tiers are in
test_kv_invariants.py."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import model
from model.config import ModelConfig
from serving import LLM, SamplingParams
from serving.kv_tiers import (DiskTier, HostTier, MooncakeTier, PageCodec, TierConfig, _frame, chain,
                              host_rows_memory, root_hash)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_keys_cover_the_whole_prefix_the_namespace_and_the_model():
    a = chain(root_hash(b"m", 0), [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # full pages only
    assert chain(root_hash(b"m", 0), [1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert chain(a[0], [5, 6, 7, 8], 4) == a[1:]  # chained: page 2's key from page 1's
    b = chain(root_hash(b"m", 0), [0, 2, 3, 4, 5, 6, 7, 8], 4)  # an earlier token differs
    assert b[0] != a[0] and b[1] != a[1]
    assert chain(root_hash(b"m", 1), [1, 2, 3, 4], 4)[0] != a[0]  # another namespace
    assert chain(root_hash(b"n", 0), [1, 2, 3, 4], 4)[0] != a[0]  # another model


def test_page_codec_round_trips_mixed_leaves():
    rng = np.random.default_rng(0)
    data = {"k": rng.standard_normal((3, 4, 2, 8)).astype(np.float32),
            "codes": rng.integers(0, 255, (3, 4, 2, 4)).astype(np.uint8),
            "scale": rng.standard_normal((3, 4, 2)).astype(np.float16)}
    codec = PageCodec(jax.tree.map(lambda a: a[:1], data))
    assert codec.page_nbytes == 4 * 2 * 8 * 4 + 4 * 2 * 4 + 4 * 2 * 2
    rows = codec.pack(data)
    assert rows.shape == (3, codec.page_nbytes) and rows.dtype == np.uint8
    back = codec.unpack(rows)
    for name in data:
        np.testing.assert_array_equal(back[name], data[name])
        assert back[name].dtype == data[name].dtype


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "fp8", "nvfp4", "turboquant-3.5"])
def test_pinned_rows_are_the_codecs_rows_and_write_back_bit_exactly(kv_cache_dtype):
    """The pinned host tier's rows, packed on the device (ModelRunner.read_rows), are
    byte for byte PageCodec's numpy rows of the same pages (so disk files are the same
    either way), live in pinned_host memory, and write_pages(upload_rows(...)) puts the
    pages back unchanged, for pools of float, bfloat16, int8, fp8, NVFP4 and TurboQuant
    pages (random bytes: bfloat16 NaNs of every payload, which a float copy would change)."""
    from serving.runner import ModelRunner

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=16, layer_kinds=("attention",) * 2, max_position_embeddings=64)
    runner = ModelRunner(config, model.init_params(config, jax.random.key(0)), num_pages=8, page_size=16,
                         max_pages_per_seq=4, max_num_seqs=1, kv_cache_dtype=kv_cache_dtype)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    runner.pool = jax.tree.map(  # every byte random, so a misplaced byte shows
        lambda a: jax.lax.bitcast_convert_type(jax.random.bits(next(keys), a.shape + (
            (a.dtype.itemsize,) if a.dtype.itemsize > 1 else ()), np.uint8), a.dtype), runner.pool)
    assert runner.host_memory is not None and runner.host_memory.memory_kind == "pinned_host"
    codec = PageCodec(runner.read_pages([0]))
    rows = runner.read_rows([5, 2, 7])
    assert all(r.sharding.memory_kind == "pinned_host" and r.shape == (codec.page_nbytes,) for r in rows)
    want = codec.pack(runner.read_pages([5, 2, 7]))
    np.testing.assert_array_equal(np.stack([np.asarray(r) for r in rows]), want)
    before = runner.read_pages([5, 2, 7])
    runner.write_pages([0, 1, 3], runner.upload_rows(rows))
    same = lambda a, b: all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(runner.read_pages([0, 1, 3]), before)
    # Every other page move is byte-exact too: host pages (swap), device pages (transfer), copy-on-write.
    runner.write_pages([4], runner.read_pages([5]))
    runner.put_pages([6], runner.take_pages([2, 7]), start=1)
    runner.copy_pages([(2, 3)])  # page 3 held page 7's bytes
    assert same(runner.read_pages([4, 3, 6]), before)


def test_auto_keeps_pinned_rows_on_accelerators_only():
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0], memory_kind="pinned_host")

    class Accelerator:  # a pinned_host Sharding of a GPU, as far as host_rows_memory looks
        device_set = {type("Gpu", (), {"platform": "gpu"})()}
    gpu = Accelerator()
    assert host_rows_memory("auto", gpu) is gpu and host_rows_memory("pinned_host", gpu) is gpu
    assert host_rows_memory("auto", cpu) is None and host_rows_memory("pinned_host", cpu) is cpu
    assert host_rows_memory("numpy", gpu) is None and host_rows_memory("auto", None) is None
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        host_rows_memory("pinned_host", None)


def test_host_tier_evicts_least_recently_used_and_never_a_pinned_page():
    host = HostTier(3 * 8, 8)
    rows = {k: np.full(8, i, np.uint8) for i, k in enumerate([b"a", b"b", b"c", b"d", b"e"])}
    for k in (b"a", b"b", b"c"):
        assert host.put(k, rows[k]) == []
    host.get(b"a")  # a is now the most recent: b goes first
    (evicted,) = host.put(b"d", rows[b"d"])
    assert evicted[0] == b"b" and (evicted[1] == rows[b"b"]).all()
    host.pinned.update([b"c", b"a", b"d"])
    assert host.put(b"e", rows[b"e"]) == [] and not host.exists(b"e")  # all pinned: dropped
    host.pinned.clear()
    assert [k for k, _ in host.put(b"e", rows[b"e"])] == [b"c"]
    assert (host.get(b"d") == rows[b"d"]).all() and host.get(b"b") is None
    host.check()
    with pytest.raises(ValueError, match="host_cache_bytes"):
        HostTier(7, 8)


def test_disk_tier_survives_restarts_detects_corruption_and_stays_bounded(tmp_path):
    d = str(tmp_path)
    disk = DiskTier(d, 3 * (32 + 16), 16)
    pages = {bytes([i]) * 16: np.arange(16, dtype=np.uint8) + i for i in range(4)}
    keys = list(pages)
    for k in keys[:3]:
        disk.put(k, pages[k])
    assert disk.exists(keys[2]) and (disk.get(keys[2]) == pages[keys[2]]).all()  # in flight or written
    disk.flush()
    assert not disk.writing
    assert (disk.get(keys[0]) == pages[keys[0]]).all()  # refreshes keys[0]
    disk.put(keys[3], pages[keys[3]])  # over the bound: keys[1], the least recent, goes
    disk.flush()
    assert not disk.exists(keys[1]) and disk.nbytes <= disk.capacity_bytes
    assert len(os.listdir(d)) == 3
    again = DiskTier(d, 3 * (32 + 16), 16)  # a new engine finds them
    assert set(again.index) == {keys[0], keys[2], keys[3]}
    assert (again.get(keys[3]) == pages[keys[3]]).all()
    path = again._path(keys[2])
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF  # one flipped payload bit
    open(path, "wb").write(bytes(raw))
    assert again.get(keys[2]) is None and not os.path.exists(path) and again.num_corrupt == 1
    with open(again._path(keys[0]), "r+b") as f:
        f.truncate(40)  # a short file (a crash mid-write by another writer)
    assert again.get(keys[0]) is None and again.num_corrupt == 2
    assert DiskTier(d, 10**6, 32).index == {}  # another page size: not this model's pages


@pytest.mark.parametrize("kw,match", [
    (dict(write_policy="sometimes"), "hicache_write_policy"),
    (dict(host_cache_bytes=0), "host_cache_bytes"),
    (dict(disk_cache_bytes=True), "disk_cache_bytes"),
    (dict(disk_cache_dir=3), "disk_cache_dir"),
    (dict(storage_backend="s3"), "hicache_storage_backend"),
    (dict(storage_backend="mooncake"), "mooncake_master='host:port'"),
    (dict(storage_backend="mooncake", mooncake_master="somewhere"), "mooncake_master='host:port'"),
    (dict(storage_backend="mooncake", mooncake_master="h:1", disk_cache_dir="/tmp"), "disk_cache_dir"),
    (dict(mooncake_master="h:1"), "hicache_storage_backend='mooncake'"),
    (dict(prefetch_policy="eager"), "hicache_storage_prefetch_policy"),
    (dict(host_memory="gpu"), "hicache_host_memory"),
])
def test_tier_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TierConfig(**kw)


@pytest.fixture(scope="module")
def tiny(default_tokenizer):
    config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 2,
                         max_position_embeddings=512, eos_token_id=2)
    return config, model.init_params(config, jax.random.key(0)), default_tokenizer


def make(tiny, **kw):
    kw = {"max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 64, "num_kv_blocks": 8, **kw}
    return LLM.from_loaded(*tiny, **kw)


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


PROMPTS = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 49152, 40).tolist()} for i in range(5)]


@pytest.mark.parametrize("kw,match", [
    (dict(host_cache_bytes=1 << 20), "enable_hierarchical_cache"),
    (dict(enable_hierarchical_cache=True, enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(enable_hierarchical_cache=True, hicache_write_policy="later"), "hicache_write_policy"),
    (dict(enable_hierarchical_cache="yes"), "enable_hierarchical_cache"),
    (dict(enable_hierarchical_cache=True, host_cache_bytes=100), "host_cache_bytes"),
    (dict(mooncake_master="127.0.0.1:1"), "enable_hierarchical_cache"),
    (dict(enable_hierarchical_cache=True, hicache_host_memory="gpu"), "hicache_host_memory"),
    (dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake", mooncake_master="127.0.0.1:1"),
     "no Mooncake master answers"),
])
def test_llm_tier_argument_validation(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        make(tiny, **kw)


def test_greedy_identical_with_prefixes_from_device_host_and_disk(tiny, tmp_path):
    """Five 40-token prompts through an 8-page pool (two pages each are cached, five
    prompts' worth does not fit): the second pass finds them in the host tier (loaded
    while a step runs, their request computing from the next), a new engine on the same
    directory on disk, and a corrupted page is recomputed."""
    alone = ids(make(tiny, enable_prefix_caching=False).generate(PROMPTS, GREEDY))
    d = str(tmp_path)
    llm = make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d, hicache_write_policy="write_through",
               hicache_host_memory="pinned_host")  # "auto" keeps numpy rows on the CPU backend
    assert ids(llm.generate(PROMPTS, GREEDY)) == alone
    host = llm.engine.tiers.host
    assert host.memory is not None and all(host.rows[s].sharding.memory_kind == "pinned_host"
                                           for s in host.slots.values())
    engine, execute, land = llm.engine, llm.engine.runner.execute, llm.engine._land
    landed = []

    def checked(rows):  # a delayed hit computes nothing in the step that loads its pages
        loading = {tuple(engine.kv.tables[sid]) for sid in engine.step_loads}
        assert not loading & {row.block_table for row in rows}
        return execute(rows)
    engine.runner.execute = checked
    engine._land = lambda pages, upload: (landed.append(pages), land(pages, upload))
    again = llm.generate(PROMPTS, GREEDY)
    assert ids(again) == alone
    assert landed, "no load overlapped a step"
    assert [o.num_cached_tokens for o in again] == [32] * 5
    hits = llm.engine.kv.hits
    assert hits["host"] > 0 and hits["device"] + hits["host"] == 5 * 32, hits
    llm.engine.kv.check()

    restarted = make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d)
    assert restarted.engine.tiers.fingerprint == llm.engine.tiers.fingerprint  # same model, same keys
    first = chain(root_hash(restarted.engine.tiers.fingerprint, 0), PROMPTS[0]["prompt_token_ids"][:16], 16)[0]
    path = restarted.engine.tiers.disk._path(first)  # prompt 0's first page, one bit flipped
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(path, "wb").write(bytes(raw))
    out = restarted.generate(PROMPTS, GREEDY)
    assert ids(out) == alone
    assert restarted.engine.tiers.disk.num_corrupt == 1
    assert [o.num_cached_tokens for o in out] == [0] + [32] * 4  # prompt 0 recomputed, whole
    assert restarted.engine.kv.hits["disk"] == 4 * 32


def test_close_lands_the_copies_and_ends_the_engine(tiny, tmp_path):
    """`with LLM(...)` closes it: its tiers and load thread stop, it refuses to generate,
    closing twice is fine, and the disk's pages serve the next engine."""
    with make(tiny, enable_hierarchical_cache=True, disk_cache_dir=str(tmp_path),
              hicache_write_policy="write_through") as llm:
        llm.generate(PROMPTS[:2], GREEDY)
    assert llm.engine.tiers.closed and llm.engine._uploader._shutdown
    assert len(llm.engine.tiers.disk.index) == 2 * 2  # two full pages per 40-token prompt
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()
    restarted = make(tiny, enable_hierarchical_cache=True, disk_cache_dir=str(tmp_path))
    restarted.generate(PROMPTS[:2], GREEDY)
    assert restarted.engine.kv.hits["disk"] == 2 * 32


def test_write_back_copies_only_evicted_pages_and_new_weights_read_none(tiny):
    llm = make(tiny, enable_hierarchical_cache=True, hicache_write_policy="write_back")
    llm.generate(PROMPTS[:1], GREEDY)
    assert len(llm.engine.tiers.host) == 0  # nothing evicted yet, nothing copied
    llm.generate(PROMPTS, GREEDY)
    assert len(llm.engine.tiers.host) > 0
    config, params, _ = tiny
    other = jax.tree.map(lambda a: a * 2, params)
    llm.update_weights(other)  # the tiers' pages were computed by the old weights
    want = ids(LLM.from_loaded(config, other, tiny[2], max_model_len=128, enable_prefix_caching=False)
               .generate(PROMPTS, GREEDY))
    out = llm.generate(PROMPTS, GREEDY)
    assert ids(out) == want and all(o.num_cached_tokens == 0 for o in out)


@pytest.mark.parametrize("host_memory", ["pinned_host", "numpy"])
def test_tier_cost_is_measured_per_page_on_the_runner(tiny, tmp_path, host_memory):
    """What `bench trace --tiers` charges a simulated page move, for either host row form:
    positive, finite, and a disk load costs at least a host load (it is a disk read and
    then one)."""
    from serving.simulator import measure_tier_cost

    cost = measure_tier_cost(make(tiny, num_kv_blocks=16), str(tmp_path), num_pages=8, repeats=1,
                             host_memory=host_memory)
    assert 0 < cost.load_host_s <= cost.load_disk_s < 1 and 0 < cost.copy_down_s < 1
    assert not os.listdir(tmp_path) or all(name.endswith(".kvpage") for name in os.listdir(tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A mooncake_master on 127.0.0.1 (the wheel's binary, beside this Python), its RPC and
    admin ports free ones; yields "host:port"."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":  # `make setup` installs it everywhere else
        pytest.importorskip("mooncake.store", reason="Mooncake's wheels are for Linux x86-64")
    port = _free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mooncake_master"),
                                 f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
                                 "--enable_metric_reporting=false"], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_mooncake_store_shares_pages_between_clients_and_drops_corrupt_ones(mooncake_master):
    with pytest.raises(ValueError, match="at least 16777216 bytes"):
        MooncakeTier(mooncake_master, 8 << 20, 4096)
    a = MooncakeTier(mooncake_master, 16 << 20, 4096)
    b = MooncakeTier(mooncake_master, 16 << 20, 4096)  # a second member of the same pool
    try:
        rows = np.random.default_rng(0).integers(0, 256, (3, 4096)).astype(np.uint8)
        keys = [bytes([i]) * 16 for i in range(3)]
        a.put(keys[0], rows[0])
        assert a.exists(keys[0]) and (a.get(keys[0]) == rows[0]).all()  # in flight or landed
        a.put(keys[1], rows[1])
        a.flush()
        assert not a.writing
        assert b.exists(keys[1]) and (b.get(keys[1]) == rows[1]).all() and (b.get(keys[0]) == rows[0]).all()
        assert not b.exists(keys[2]) and b.get(keys[2]) is None
        bad = bytearray(_frame(rows[2]))
        bad[-1] ^= 0x10  # one flipped payload bit, as a faulty writer would leave it
        assert a.store.put(a._name(keys[2]), bytes(bad)) == 0
        assert b.exists(keys[2]) and b.get(keys[2]) is None and b.num_corrupt == 1
        assert not a.exists(keys[2])  # removed from the pool: the tokens are recomputed
        assert a.store.put(a._name(keys[2]), _frame(rows[2][:100])) == 0  # a short page
        assert b.get(keys[2]) is None and b.num_corrupt == 2
    finally:
        a.close()
        b.close()


OTHER_ENGINE = """
import json, sys, jax
import model
from model.config import ModelConfig
from serving import LLM, SamplingParams
fields = json.loads(sys.argv[1])
config = ModelConfig(**{**fields, "layer_kinds": tuple(fields["layer_kinds"])})
params = model.init_params(config, jax.random.key(0))
llm = LLM.from_loaded(config, params, model.load_tokenizer("default"), max_model_len=128, max_num_seqs=2,
                      max_num_batched_tokens=64, num_kv_blocks=8, enable_hierarchical_cache=True,
                      hicache_storage_backend="mooncake", mooncake_master=sys.argv[2], disk_cache_bytes=16 << 20)
out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[3])],
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print(json.dumps(dict(ids=[o.outputs[0].token_ids for o in out], cached=[o.num_cached_tokens for o in out],
                      hits=dict(llm.engine.kv.hits))))
llm.engine.tiers.close()
"""


def test_engines_in_two_processes_share_prefixes_through_a_mooncake_store(tiny, mooncake_master):
    """One engine computes five prompts (no cache hit) and writes their pages through to
    the store; an engine in another process, its device and host tiers empty, is served
    every full page from the store and answers the same greedy tokens."""
    llm = make(tiny, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
               mooncake_master=mooncake_master, disk_cache_bytes=16 << 20, hicache_write_policy="write_through")
    try:
        alone = ids(llm.generate(PROMPTS, GREEDY))  # every cache empty: computed; generate lands the copies
        assert sum(llm.engine.kv.hits.values()) == 0
        config = {f: getattr(tiny[0], f) for f in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                                                   "num_kv_heads", "head_dim", "layer_kinds",
                                                   "max_position_embeddings", "eos_token_id")}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        done = subprocess.run([sys.executable, "-c", OTHER_ENGINE, json.dumps(config), mooncake_master,
                               json.dumps([p["prompt_token_ids"] for p in PROMPTS])],
                              capture_output=True, text=True, timeout=600, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
        assert done.returncode == 0, done.stderr[-4000:]
        other = json.loads(done.stdout.strip().splitlines()[-1])
        assert other["ids"] == alone
        assert other["cached"] == [32] * 5 and other["hits"].get("store") == 5 * 32, other
    finally:
        llm.engine.tiers.close()


def _gated_disk(tiers):
    """Make the disk's reads of the pages it holds wait for `gate`, and count them by key
    (a lookup of a page it does not hold answers at once)."""
    import collections
    import threading

    gate, reads, get = threading.Event(), collections.Counter(), tiers.disk.get

    def gated(key):
        if tiers.disk.exists(key):
            reads[key] += 1
            gate.wait(60)
        return get(key)

    tiers.disk.get = gated
    return gate, reads


def _run(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p["prompt_token_ids"], GREEDY)
    while engine.has_unfinished():
        engine.step()
    out = [(engine.seqs[engine.requests[f"r{i}"].seq_ids[0]].output.tokens, engine.requests[f"r{i}"].num_cached_tokens)
           for i in range(len(prompts))]
    for i in range(len(prompts)):
        engine.release(f"r{i}")
    return out


def test_a_prefetch_defers_its_requests_and_a_delayed_hit_waits_for_the_same_load(tiny, tmp_path):
    """Strata / HiCache on a restarted engine whose prefixes are all on disk: a request
    whose disk hit passes the threshold starts a background prefetch and is deferred
    while a request without a hit runs; a second request on the same prefix joins that
    load (each page is read once); once the pages land both are admitted with their
    prefix served, and greedy tokens equal a cache-less engine's."""
    fresh = {"prompt_token_ids": np.random.default_rng(9).integers(3, 49152, 40).tolist()}
    alone = ids(make(tiny, enable_prefix_caching=False).generate([PROMPTS[0], fresh], GREEDY))
    d = str(tmp_path)
    make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d, hicache_write_policy="write_through").generate(
        PROMPTS[:1], GREEDY)
    llm = make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d, max_num_seqs=3,
               hicache_storage_prefetch_policy="wait_complete")  # c's first step compiles: past any timeout
    engine, tiers = llm.engine, llm.engine.tiers
    assert tiers.host.memory is None and isinstance(tiers.host.rows, np.ndarray)  # "auto" on the CPU backend
    tiers.prefetch_threshold = 16  # the prompt's 32 cached tokens pass it (HiCache's default: 256)
    gate, reads = _gated_disk(tiers)
    for rid, p in (("a", PROMPTS[0]), ("b", PROMPTS[0]), ("c", fresh)):
        engine.add_request(rid, p["prompt_token_ids"], GREEDY)
    engine.step()  # a and b wait for the load, c runs
    assert {s.seq_id for s in engine.state.running} == set(engine.requests["c"].seq_ids)
    assert set(engine._loading) == set(engine.requests["a"].seq_ids + engine.requests["b"].seq_ids)
    assert len(reads) == 2 and set(reads.values()) == {1}  # two pages, each read once, for both
    gate.set()
    while engine.has_unfinished():
        engine.step()
    out = {r: (engine.seqs[engine.requests[r].seq_ids[0]].output.tokens, engine.requests[r].num_cached_tokens)
           for r in "abc"}
    assert [out["a"][0], out["b"][0], out["c"][0]] == [alone[0], alone[0], alone[1]]
    assert out["a"][1] == out["b"][1] == 32 and out["c"][1] == 0
    assert tiers.pages_prefetched == 2 and engine.kv.hits["disk"] == 32 and set(reads.values()) == {1}
    engine.kv.check()


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
def test_a_prefetch_past_its_timeout_or_best_effort_never_stalls_the_request(tiny, tmp_path, policy):
    """A disk that does not answer: with the timeout passed (or best_effort, which never
    waits), the request is admitted without the pages still in flight (never reading
    them twice, never waiting on them) and recomputes them: same greedy tokens."""
    d = str(tmp_path)
    alone = ids(make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d, hicache_write_policy="write_through")
                .generate(PROMPTS[:1], GREEDY))
    llm = make(tiny, enable_hierarchical_cache=True, disk_cache_dir=d, hicache_storage_prefetch_policy=policy)
    tiers = llm.engine.tiers
    tiers.prefetch_threshold = 16
    tiers.prefetch_timeout = lambda num_tokens: 0.0
    gate, reads = _gated_disk(tiers)
    try:
        ((tokens, cached),) = _run(llm.engine, PROMPTS[:1])
    finally:
        gate.set()
    assert [tokens] == alone and cached == 0 and set(reads.values()) == {1}


def test_bench_tiers_replays_a_trace_with_identical_tokens_in_every_setup(tmp_path, default_tokenizer, capsys):
    """`python -m serving.bench tiers` at tiny size on a conversation-shaped trace (turns
    that extend earlier ones): every setup decodes the same tokens, the unbounded pool
    serves at least what the device alone does, and each row has a TTFT."""
    from serving import bench
    from tests.serving.test_server import write_tiny_checkpoint

    write_tiny_checkpoint(str(tmp_path / "tiny"), default_tokenizer)
    turns = [[1, 2], [3], [1, 2, 4], [5, 6], [3, 7], [1, 2, 4, 8], [5, 6, 9], [3, 7, 10]]
    (tmp_path / "trace.jsonl").write_text("".join(
        json.dumps(dict(timestamp=i, input_length=512 * len(h), output_length=64, hash_ids=h)) + "\n"
        for i, h in enumerate(turns)))
    bench.main(["tiers", str(tmp_path / "trace.jsonl"), "--model", str(tmp_path / "tiny"), "--num-requests", "8",
                "--block-tokens", "16", "--output-scale", "0.0625", "--max-model-len", "128", "--kv-blocks", "6",
                "--host-pages", "3", "--concurrency", "2", "--write-policy", "write_through"])
    rows = {r[0].strip(): [c.strip() for c in r[1:]] for r in
            (line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| "))
            if r[0].strip() not in ("cache", "---")}
    assert list(rows) == ["device only", "device + host (2x device)", "device + small host + disk",
                          "unbounded device"]
    assert all(r[-1] == "yes" for r in rows.values())
    assert float(rows["unbounded device"][0]) >= float(rows["device only"][0]) and \
        float(rows["unbounded device"][0]) > 0
    for r in rows.values():
        p50, p90 = (float(x) for x in r[5].split("/"))
        assert 0 <= p50 <= p90 < 60
