"""Kernel tests of `gpu_sched.kernels.sort_keys` and `gpu_sched.kernels.dfs_weight`: every
checked launcher against plain-Python values of the same formula, at sizes 0, 1, BLOCK-1,
BLOCK, BLOCK+1 and a larger one, with tied and all-equal keys; exact integer equality; the
failure message names the first differing index. Without CUDA the kernels run in Triton's
interpreter (`TRITON_INTERPRET=1`, set by conftest.py before anything imports triton); with
CUDA they are compiled and the tests' tensors live on the GPU.
"""

import random
import struct

import pytest
import torch

triton = pytest.importorskip("triton")

from gpu_sched.kernels import dfs_weight as DW  # noqa: E402
from gpu_sched.kernels import sort_keys as SK  # noqa: E402
from gpu_sched.kernels._utils import DEFAULT_BLOCK, block_config, is_interpreted  # noqa: E402

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# with CUDA the compiled kernels need CUDA tensors: the tests' tensors go there (conftest.py)
pytestmark = pytest.mark.usefixtures("cuda_default_device")

# (n, block): 0, 1, BLOCK-1, BLOCK, BLOCK+1 for two blocks, and a few blocks' worth
SIZES = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (127, 128), (128, 128), (129, 128),
         (300, 16), (300, None)]
SIZE_IDS = [f"n{n}-b{b or DEFAULT_BLOCK}" for n, b in SIZES]


def assert_equal(got, want, what):
    got = [int(x) for x in (got.tolist() if isinstance(got, torch.Tensor) else got)]
    want = [int(x) for x in (want.tolist() if isinstance(want, torch.Tensor) else want)]
    assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise AssertionError(f"{what}: first difference at index {i}: got {g}, want {w}")


def order_bits(t: float) -> int:
    """Python model of the float64 order key."""
    if t == 0.0:
        t = 0.0
    b = struct.unpack("<q", struct.pack("<d", t))[0]
    return b ^ INT64_MAX if b < 0 else b


def test_kernels_are_interpreted_without_cuda():
    assert is_interpreted(SK._fcfs_keys_kernel) == (not torch.cuda.is_available())


def test_block_config():
    assert block_config(None) == (DEFAULT_BLOCK, 4)
    assert block_config(16) == (16, 4)
    assert block_config(4096) == (4096, 8)
    for bad in (0, 15, 24, 2**14):
        with pytest.raises(ValueError, match="power of two"):
            block_config(bad)
    with pytest.raises(TypeError):
        block_config(16.0)


# ---- fcfs / lof ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("sign", [1, -1])
def test_fcfs_keys(n, block, sign):
    rng = random.Random(n + sign)
    prio = [rng.choice([INT64_MIN, INT64_MAX, -1, 0, 0, 5]) for _ in range(n)]
    times = [rng.choice([0.0, -0.0, 1.5, -2.25, float("inf"), -float("inf"), 1e-300]) for _ in range(n)]
    pk, tk = SK.fcfs_keys(torch.tensor(prio, dtype=torch.int64), torch.tensor(times, dtype=torch.float64),
                          sign, block=block)
    assert_equal(pk, [p if sign > 0 else ~p for p in prio], "pk")
    assert_equal(tk, [order_bits(t) for t in times], "tk")
    # the keys order like the Python values (ties included)
    assert sorted(range(n), key=lambda i: (prio[i] * sign, times[i])) == sorted(
        range(n), key=lambda i: (int(pk[i]), int(tk[i])))


@pytest.mark.parametrize("n,block", SIZES[:6], ids=SIZE_IDS[:6])
def test_fcfs_keys_integer_times_all_equal(n, block):
    pk, tk = SK.fcfs_keys(torch.full((n,), 3, dtype=torch.int32), torch.full((n,), -9, dtype=torch.int64),
                          -1, block=block)
    assert_equal(pk, [~3] * n, "pk")
    assert_equal(tk, [-9] * n, "tk")


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("with_prio", [False, True])
def test_lof_keys(n, block, with_prio):
    rng = random.Random(n * 3 + with_prio)
    max_new = [rng.choice([0, 1, 7, 7, 2**31 - 1]) for _ in range(n)]
    prio = [rng.choice([INT64_MIN, 2, 2, INT64_MAX]) for _ in range(n)]
    pk, mk = SK.lof_keys(torch.tensor(max_new, dtype=torch.int32),
                         torch.tensor(prio, dtype=torch.int64) if with_prio else None, -1, block=block)
    assert_equal(mk, [-m - 1 for m in max_new], "mk")
    if with_prio:
        assert_equal(pk, [~p for p in prio], "pk")
    else:
        assert pk is None


# ---- routing-key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_routing_counts_and_keys(n, block):
    rng = random.Random(n * 5)
    K = 6
    ranks = [4, 0, 5, 1, 3, 2]
    running = [rng.choice([-1, 0, 2, 2, 5, 7]) for _ in range(n)]  # 7 is out of range: absent
    counts = SK.routing_counts(torch.tensor(running, dtype=torch.int32), K, block=block)
    want_counts = [sum(1 for r in running if r == k) for k in range(K)] + [sum(1 for r in running if not 0 <= r < K)]
    assert_equal(counts, want_counts, "counts")
    waiting = [rng.choice([-1, 0, 1, 2, 5, 9]) for _ in range(n)]
    m = len(running)
    keys = SK.routing_keys(torch.tensor(waiting, dtype=torch.int64), torch.tensor(ranks, dtype=torch.int32),
                           counts, m, -1, block=block)

    def want(k):
        valid = 0 <= k < K
        c = want_counts[k] if valid else 0
        rank = ranks[k] if valid else -1
        return (m - c if c > 0 else m) * 2**32 + rank + 2**31

    assert_equal(keys, [want(k) for k in waiting], "keys")


def test_routing_with_no_ids():
    counts = SK.routing_counts(torch.tensor([-1, 3], dtype=torch.int32), 0, block=16)
    assert_equal(counts, [2], "counts")
    keys = SK.routing_keys(torch.tensor([-1, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), counts, 2, -1)
    assert_equal(keys, [2 * 2**32 + 2**31 - 1] * 2, "keys")


# ---- lpm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_lpm_keys(n, block):
    rng = random.Random(n * 7)
    matched = [rng.choice([0, 0, 3, 2**40]) for _ in range(n)]
    dep = [rng.random() < 0.3 for _ in range(n)]
    keys = SK.lpm_keys(torch.tensor(matched, dtype=torch.int64), torch.tensor(dep, dtype=torch.bool), block=block)
    assert_equal(keys, [INT64_MAX if d else -x - 1 for x, d in zip(matched, dep)], "lpm keys")


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_lpm_keys_with_cap_and_valid(n, block):
    """lpm keys with the cap (min(matched, cap)) and the padding (not valid: last, as the
    deprioritized) read in the launch, and `lpm_order` with them in every form: the same
    permutation as capping and masking first."""
    from gpu_sched import policy as P

    rng = random.Random(n * 13 + 1)
    matched = torch.tensor([rng.choice([0, 3, 9, 2**40]) for _ in range(n)], dtype=torch.int64)
    cap = torch.tensor([rng.choice([0, 4, 2**41]) for _ in range(n)], dtype=torch.int64)
    dep = torch.tensor([rng.random() < 0.2 for _ in range(n)], dtype=torch.bool)
    valid = torch.tensor([rng.random() < 0.8 for _ in range(n)], dtype=torch.bool)
    keys = SK.lpm_keys(matched, dep, cap=cap, valid=valid, block=block)
    want_keys = [INT64_MAX if d or not v else -min(x, c) - 1
                 for x, c, d, v in zip(matched.tolist(), cap.tolist(), dep.tolist(), valid.tolist())]
    assert_equal(keys, want_keys, "lpm keys (cap, valid)")
    want = P.lpm_order(torch.minimum(matched, cap).cpu(), (dep | ~valid).cpu())
    assert torch.equal(P.lpm_order(matched, dep, cap=cap, valid=valid, backend="triton").cpu(), want)
    assert torch.equal(P.lpm_order(matched.cpu(), dep.cpu(), cap=cap.cpu(), valid=valid.cpu()), want)
    with P.torch_forms():
        assert torch.equal(P.lpm_order(matched.cpu(), dep.cpu(), cap=cap.cpu(), valid=valid.cpu()), want)


# ---- R-ORD-9 -----------------------------------------------------------------------------------------
def _deprio_sequential(pre, fill, ns, h, check, T, valid):
    """R-ORD-9 by its sequential definition: a later eligible member of a group already seen."""
    seen, want = set(), []
    for p, f, a, x, v in zip(pre, fill, ns, h, valid):
        eligible = v and p <= check and f >= T
        want.append(eligible and (a, x) in seen)
        if eligible:
            seen.add((a, x))
    return want


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("check,T", [(0, 1), (5, 4), (2**40, 1)])
@pytest.mark.parametrize("with_valid", [False, True])
def test_deprio_by_hash(n, block, check, T, with_valid):
    rng = random.Random(n * 13 + T + with_valid)
    pre = [rng.choice([0, 0, 3, 5, 6, 100]) for _ in range(n)]
    fill = [rng.choice([1, 3, 4, 4, 9]) for _ in range(n)]
    ns = [rng.choice([0, 1, 1, 2**31 - 1, -(2**31)]) for _ in range(n)]
    h = [rng.choice([5, 6, 6, -(2**62), 2**62 - 1]) for _ in range(n)]
    valid = [rng.random() < 0.8 for _ in range(n)] if with_valid else [True] * n
    t = lambda x, d=torch.int64: torch.tensor(x, dtype=d)  # noqa: E731
    got = SK.deprio_by_hash(t(pre, torch.int32), t(fill), t(ns, torch.int32), t(h), check, T,
                            valid=t(valid, torch.bool) if with_valid else None, block=block)
    assert got.dtype == torch.bool
    want = _deprio_sequential(pre, fill, ns, h, check, T, valid)
    assert_equal(got, want, "deprioritized")
    if n >= 33:
        assert any(want) and not all(want)  # sanity: both outcomes occur
    # the policy function on triton equals its torch form (valid: padding rows take no part)
    from gpu_sched import policy as P

    args = (t(pre), t(fill), t(ns), t(h), check, T)
    vk = dict(valid=t(valid, torch.bool)) if with_valid else {}
    with P.torch_forms():
        assert torch.equal(P.in_batch_deprioritize(*args, backend="triton", **vk).cpu(),
                           P.in_batch_deprioritize(*(x.cpu() if torch.is_tensor(x) else x for x in args),
                                                   **{k: v.cpu() for k, v in vk.items()}))


def test_deprio_by_hash_one_group_and_all_distinct():
    n = 70  # more than one program: the table's claims cross programs
    z = torch.zeros(n, dtype=torch.int64)
    got = SK.deprio_by_hash(z, z + 4, z, z + 9, 0, 1, block=16)
    assert_equal(got, [False] + [True] * (n - 1), "one group")
    got = SK.deprio_by_hash(z, z + 4, z, torch.arange(n) * (2**40 + 7), 0, 1, block=16)
    assert_equal(got, [False] * n, "all distinct")
    assert SK.deprio_by_hash(z[:0], z[:0], z[:0], z[:0], 0, 1).numel() == 0


# ---- dfs-weight passes -----------------------------------------------------------------------------
def random_tree(N, rng):
    parent = [-1] + [rng.randrange(max(0, i - 3), i) if rng.random() < 0.5 else rng.randrange(i) for i in range(1, N)]
    kids = {}
    rank = [0] * N
    for v in range(1, N):
        rank[v] = kids.get(parent[v], 0)
        kids[parent[v]] = rank[v] + 1
    return parent, rank


def ancestors(parent, v):
    out = []
    while v >= 0:
        out.append(v)
        v = parent[v]
    return out


DFS_SIZES = [(1, 16), (2, 16), (15, 16), (16, 16), (17, 16), (129, 128), (300, 16)]


@pytest.mark.parametrize("N,block", DFS_SIZES, ids=[f"N{N}-b{b}" for N, b in DFS_SIZES])
def test_dfs_passes_against_python(N, block):
    rng = random.Random(N)
    parent, rank = random_tree(N, rng)
    n = N + 3
    last = [rng.choice([-1, 0, rng.randrange(N), N + 5]) for _ in range(n)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    node_of = [v if 0 <= v < N else 0 for v in last]
    want_own = [node_of.count(v) for v in range(N)]
    # weight rounds: after k rounds S_k(v) = own of nodes u with v = anc^j(u), j < 2^k; up to
    # 5 rounds, so that the three rotating buffers each serve twice
    for k in range(max(5, (N - 1).bit_length()) + 1):
        own, s = DW.subtree_weights(t(last), t(parent), k, block=block)
        assert_equal(own, want_own, f"own ({k} rounds)")
        want_s = [0] * N
        for u in range(N):
            for j, v in enumerate(ancestors(parent, u)):
                if j < 2 ** k:
                    want_s[v] += want_own[u]
        assert_equal(s, want_s, f"weights after {k} rounds")
    weight = want_s
    # sibling keys
    for pack in (False, True):
        key = DW.sibling_keys(t(parent), torch.tensor(rank, dtype=torch.int32), s, n, pack_rank=pack, block=block)
        want_key = [((p + 1) * (n + 1) + (n - w)) * (N if pack else 1) + (r if pack else 0)
                    for p, w, r in zip(parent, weight, rank)]
        assert_equal(key, want_key, f"sibling keys pack={pack}")
    # sibling offsets along the packed keys' order: the weight of the siblings sorted before
    order = sorted(range(N), key=lambda v: want_key[v])
    got_off = DW.sibling_offsets(t(order), t(parent), s, block=block)
    before = {v: sum(weight[u] for u in order[:order.index(v)] if parent[u] == parent[v]) for v in range(N)}
    assert_equal(got_off, [before[v] for v in range(N)], "sibling offsets")
    assert N < 3 or any(before.values())
    # start rounds on arbitrary offsets: T = path sums over 2^k ancestors
    off = [rng.randrange(5) if v else 0 for v in range(N)]
    tt, anc = t(off), t(parent)
    for k in range(max(1, (N - 1).bit_length())):
        tt, anc = DW.start_round(tt, anc, block=block)
        want_t = [sum(off[v] for j, v in enumerate(ancestors(parent, u)) if j < 2 ** (k + 1)) for u in range(N)]
        assert_equal(tt, want_t, f"starts after round {k + 1}")
    base = DW.request_bases(t(last), tt, s, own, block=block)
    want_base = [int(tt[v]) + weight[v] - want_own[v] for v in node_of]
    assert_equal(base, want_base, "request bases")
    tb = [rng.randrange(7) for _ in range(n)]
    packed = DW.request_bases(t(last), tt, s, own, tiebreak=torch.tensor(tb, dtype=torch.int32), tiebreak_bound=7,
                              block=block)
    assert_equal(packed, [b * 7 + x for b, x in zip(want_base, tb)], "request bases packed with the tiebreak")


def test_dfs_passes_empty_queue():
    own, s = DW.subtree_weights(torch.zeros(0, dtype=torch.int64), torch.tensor([-1, 0, 0]), 2, block=16)
    assert_equal(own, [0, 0, 0], "own")
    assert_equal(s, [0, 0, 0], "weights")
    assert DW.request_bases(torch.zeros(0, dtype=torch.int32), own, own, own).numel() == 0


@pytest.mark.parametrize("n,N,block", [(0, 1, 16), (5, 40, 16), (40, 5, 16), (130, 70, 32)])
def test_match_nodes_against_python(n, N, block):
    """The recorded step's dfs-weight inputs (`match_nodes`, one launch): each match's node and
    partial-cover tiebreak, dead slots detached, request and node counts either way round."""
    rng = random.Random(n * 7 + N)
    T = 60  # pool tokens, each owned by one of N nodes with a key of 1..6 tokens around it
    owner = [rng.randrange(N) for _ in range(T)]
    key_off = [rng.randrange(T) for _ in range(N)]
    key_len = [rng.randrange(1, 7) for _ in range(N)]
    alive = [rng.random() < 0.7 for _ in range(N)]
    parent = [-1] + [rng.randrange(v) for v in range(1, N)]
    m = [rng.choice([0, 0, 3, 9]) for _ in range(n)]
    pos = [rng.randrange(T) if k else rng.choice([-(2**40), 10**12]) for k in m]  # read only where m > 0
    cap = 50
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    node, tb, live = DW.match_nodes(t(m), t(pos), t(owner), t(key_off), t(key_len), torch.tensor(alive),
                                    t(parent), cap, block=block)
    want_node, want_tb = [], []
    for k, p in zip(m, pos):
        v = owner[p] if k > 0 else 0
        cover = p - key_off[v] + 1
        want_node.append(v)
        want_tb.append(cap - cover if k > 0 and cover < key_len[v] else 0)
    assert_equal(node, want_node, "node")
    assert_equal(tb, want_tb, "tiebreak")
    assert_equal(live, [p if a else -1 for p, a in zip(parent, alive)], "live parent")
    if n:
        assert any(want_tb) and 0 in want_tb[:n]  # both kinds of cover occur
    with pytest.raises(ValueError, match="match_nodes: cap must be"):
        DW.match_nodes(t(m), t(pos), t(owner), t(key_off), t(key_len), torch.tensor(alive), t(parent), 0)
    with pytest.raises(ValueError, match="match_nodes: parent must have"):
        DW.match_nodes(t(m), t(pos), t(owner), t(key_off), t(key_len), torch.tensor(alive), t(parent + [0]), cap)


# ---- launcher checks -------------------------------------------------------------------------------
def test_launchers_reject_bad_arguments():
    i64 = torch.zeros(8, dtype=torch.int64)
    f64 = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(TypeError, match="fcfs_keys: priority must have dtype int32 or int64, got float64"):
        SK.fcfs_keys(f64, f64, 1)
    with pytest.raises(ValueError, match="fcfs_keys: enqueue_time must have 8 elements, got 7"):
        SK.fcfs_keys(i64, f64[:7], 1)
    with pytest.raises(ValueError, match="must be contiguous"):
        SK.fcfs_keys(torch.zeros(16, dtype=torch.int64)[::2], f64, 1)
    with pytest.raises(ValueError, match="sign must be"):
        SK.fcfs_keys(i64, f64, 2)
    with pytest.raises(ValueError, match="must be 1-D"):
        SK.lpm_keys(i64.view(2, 4), torch.zeros(8, dtype=torch.bool))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        SK.lpm_keys([0, 1], torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="meta tensors"):
        SK.lpm_keys(torch.zeros(8, dtype=torch.int64, device="meta"), torch.zeros(8, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="counts must have 3 elements"):
        SK.routing_keys(i64, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 1, -1)
    with pytest.raises(ValueError, match="num_running"):
        SK.routing_keys(i64, torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), -1, -1)
    with pytest.raises(ValueError, match="check_threshold"):
        SK.deprio_by_hash(i64, i64, i64, i64, -2, 1)
    with pytest.raises(ValueError, match="deprio_by_hash: threshold must be"):
        SK.deprio_by_hash(i64, i64, i64, i64, 0, 0)
    with pytest.raises(TypeError, match="deprio_by_hash: head_hash must have dtype int64"):
        SK.deprio_by_hash(i64, i64, i64, i64.to(torch.int32), 0, 1)
    with pytest.raises(TypeError, match="subtree_weights: parent must have dtype int64"):
        DW.subtree_weights(i64, i64.to(torch.int32), 1)
    with pytest.raises(ValueError, match="subtree_weights: rounds must be in"):
        DW.subtree_weights(i64, i64, -1)
    with pytest.raises(ValueError, match="request_bases: tiebreak and tiebreak_bound go together"):
        DW.request_bases(i64, i64, i64, i64, tiebreak=i64)
    with pytest.raises(ValueError, match="sibling_offsets: weight must have 8 elements"):
        DW.sibling_offsets(i64, i64, i64[:4])
    with pytest.raises(ValueError, match="start_round: anc must have 8 elements"):
        DW.start_round(i64, i64[:4])
    with pytest.raises(ValueError, match="subtree_weights: parent must hold at least the root"):
        DW.subtree_weights(i64, i64[:0], 1)
    with pytest.raises(ValueError, match="block must be a power of two"):
        SK.lpm_keys(i64, torch.zeros(8, dtype=torch.bool), block=100)


@pytest.mark.parametrize("T", [1, 8, 70])
@pytest.mark.parametrize("seed", range(3))
def test_head_hashes_pool_forms_agree(T, seed):
    """R-ORD-9's head hashes read from a token pool: the kernel (`head_hashes_pool`, one
    launch), the torch form (a gather of the heads, then `head_hashes`'s float64 matmuls in
    chunks of 64 positions) and the host form agree, for fills shorter and longer than T,
    empty fills, starts whose T positions run past the pool's end (clamped), token ids up to
    2^31 - 1, and an empty pool (token 0)."""
    from gpu_sched import policy as P

    rng = random.Random(seed * 10 + T)
    K = rng.choice([40, 300])
    tok = torch.tensor([rng.choice([0, 1, 2**31 - 1, rng.randrange(2**31)]) for _ in range(K)], dtype=torch.int32)
    n = 33
    toff = torch.tensor([rng.choice([0, K - 1, K - 3, rng.randrange(K)]) for _ in range(n)], dtype=torch.int64)
    fill = torch.tensor([rng.choice([0, 1, T - 1, T, T + 5, rng.randrange(100)]) for _ in range(n)], dtype=torch.int64)
    fill = fill.clamp(min=0)
    for pool in (tok, tok[:0]):
        want = P.head_hashes_pool(pool, toff, fill, T)
        for block in (16, None):
            got = SK.head_hashes_pool(pool, toff, fill, P._hash_weights(2 * T, toff.device), P._HASH_MOD, block=block)
            assert_equal(got, want, f"T={T} pool={pool.numel()} block={block}")
        assert torch.equal(P.head_hashes_pool(pool, toff, fill, T, backend="triton"), want)
        if pool.numel():  # the host form on the same heads
            cols = (toff[:, None] + torch.arange(T)).clamp(0, pool.numel() - 1)
            host = P.head_hashes_host(pool[cols].cpu().numpy(), fill.clamp(max=T).cpu().numpy())
            assert want.tolist() == host.tolist()
    with pytest.raises(ValueError, match="modulus must be 2\\^31 - 1, got 1000003"):  # folding needs p = 2^31 - 1
        SK.head_hashes_pool(tok, toff, fill, P._hash_weights(2 * T, toff.device), 1000003)


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_valid_first_is_a_stable_partition(n, block):
    """`valid_first`: the entries of a permutation below the real count first, padding after,
    each part in its order (the recorded step's "padding last"), against the stable sort it
    replaces, for every real count from none to all, across blocks."""
    rng = random.Random(n)
    perm = list(range(n))
    rng.shuffle(perm)
    p = torch.tensor(perm, dtype=torch.int64)
    for real in sorted({0, 1, n // 2, max(n - 1, 0), n}):
        want = p[torch.sort((p >= real).to(torch.int8), stable=True).indices]
        got = SK.valid_first(p, torch.tensor(real, dtype=torch.int64), block=block)
        assert_equal(got, want, f"n={n} real={real}")
