"""Tests for autoplan.cost_models: collectives, resharding, cluster specs and TOML, memory."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import autoplan.cost_models as cm
from autoplan.cost_models import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_KINDS,
    PRESET_NAMES,
    REDUCE_SCATTER,
    SEND_RECV,
    ClusterSpec,
    CollectiveStep,
    DeviceSpec,
    LinkSpec,
    OptimizerSpec,
    bytes_moved_per_device,
    collective_time,
    load_cluster,
    optimizer_step_time,
    parse_memory_size,
    preset_table,
    reshard_steps,
    reshard_time,
    roofline_time,
    steps_time,
)
from autoplan.errors import AutoplanError
from autoplan.sharding import P, R, S, is_valid, reduce_scatter_first

LINK = LinkSpec(bandwidth=1e9, latency=1e-6)


def single_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, repr(text)
    return text


# ---------------------------------------------------------------------------------------------
# Ring collectives


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_bytes_moved(n: int) -> None:
    b = 1e6
    assert bytes_moved_per_device(ALL_REDUCE, b, n) == pytest.approx(2 * (n - 1) / n * b)
    assert bytes_moved_per_device(ALL_GATHER, b, n) == pytest.approx((n - 1) / n * b)
    assert bytes_moved_per_device(REDUCE_SCATTER, b, n) == pytest.approx((n - 1) / n * b)
    assert bytes_moved_per_device(ALL_TO_ALL, b, n) == pytest.approx((n - 1) / n * b)
    assert bytes_moved_per_device(SEND_RECV, b, n) == pytest.approx(b)
    # A ring all-reduce is a reduce-scatter followed by an all-gather.
    assert bytes_moved_per_device(ALL_REDUCE, b, n) == pytest.approx(
        bytes_moved_per_device(REDUCE_SCATTER, b, n) + bytes_moved_per_device(ALL_GATHER, b, n)
    )


def test_collective_time_formulas() -> None:
    b, n = 8e6, 4
    assert collective_time(ALL_REDUCE, b, n, LINK) == pytest.approx(2 * 3 / 4 * b / 1e9 + 2 * 3 * 1e-6)
    assert collective_time(ALL_GATHER, b, n, LINK) == pytest.approx(3 / 4 * b / 1e9 + 3 * 1e-6)
    assert collective_time(REDUCE_SCATTER, b, n, LINK) == pytest.approx(3 / 4 * b / 1e9 + 3 * 1e-6)
    assert collective_time(ALL_TO_ALL, b, n, LINK) == pytest.approx(3 / 4 * b / 1e9 + 3 * 1e-6)
    assert collective_time(SEND_RECV, b, n, LINK) == pytest.approx(b / 1e9 + 1e-6)


def test_latency_terms_alone() -> None:
    slow = LinkSpec(bandwidth=1e12, latency=1e-3)
    assert collective_time(ALL_REDUCE, 0, 8, slow) == pytest.approx(14e-3)
    assert collective_time(ALL_GATHER, 0, 8, slow) == pytest.approx(7e-3)
    assert collective_time(REDUCE_SCATTER, 0, 8, slow) == pytest.approx(7e-3)
    assert collective_time(ALL_TO_ALL, 0, 8, slow) == pytest.approx(7e-3)
    assert collective_time(SEND_RECV, 0, 8, slow) == pytest.approx(1e-3)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_one_device_is_free(kind: str) -> None:
    assert collective_time(kind, 1e9, 1, LINK) == 0
    assert bytes_moved_per_device(kind, 1e9, 1) == 0


def test_unknown_collective_rejected() -> None:
    with pytest.raises(ValueError):
        collective_time("gather", 1.0, 4, LINK)


def test_broadcast_is_a_binomial_tree() -> None:
    link = LinkSpec(1e9, 1e-5)
    assert collective_time("broadcast", 1e6, 8, link) == pytest.approx(1e6 / 1e9 + 3 * 1e-5)
    assert collective_time("broadcast", 1e6, 5, link) == pytest.approx(1e6 / 1e9 + 3 * 1e-5)  # ceil(log2 5)
    assert collective_time("broadcast", 1e6, 1, link) == 0.0


# ---------------------------------------------------------------------------------------------
# Resharding

SHAPE = (8, 16)  # 128 elements
ITEM = 4  # bytes
FULL = 8 * 16 * ITEM  # 512 bytes


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        (R, R, []),
        (R, S(0), []),
        (R, P, []),
        (S(0), P, []),
        (P, P, []),
        (S(1), S(1), []),
        (S(0), R, [(ALL_GATHER, 0, FULL)]),
        (S(1), R, [(ALL_GATHER, 0, FULL)]),
        (S(0), S(1), [(ALL_TO_ALL, 0, FULL / 4)]),
        (P, R, [(ALL_REDUCE, 0, FULL)]),
        (P, S(1), [(REDUCE_SCATTER, 0, FULL)]),
    ],
)
def test_reshard_steps_1d(src, dst, expected) -> None:
    steps = reshard_steps((src,), (dst,), SHAPE, ITEM, (4,))
    assert [(s.kind, s.mesh_axis, s.nbytes) for s in steps] == expected


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        # DTensor's order: nested shards are undone inner axis first
        ((S(0), S(1)), (R, R), [(ALL_GATHER, 1, FULL / 2), (ALL_GATHER, 0, FULL)]),
        ((P, R), (S(0), R), [(REDUCE_SCATTER, 0, FULL)]),
        ((S(0), R), (S(1), R), [(ALL_TO_ALL, 0, FULL / 2)]),
        ((R, R), (S(0), S(1)), []),
        ((R, R), (P, S(0)), []),
        ((P, P), (R, R), [(ALL_REDUCE, 0, FULL), (ALL_REDUCE, 1, FULL)]),
        # reduce-scatter on axis 0 shrinks the buffer the second one reads
        ((P, P), (S(0), S(1)), [(REDUCE_SCATTER, 0, FULL), (REDUCE_SCATTER, 1, FULL / 2)]),
        # partial sums reduce-scattered before the other axis is all-reduced (HSDP's gradient)
        ((P, P), (R, S(1)), [(REDUCE_SCATTER, 1, FULL), (ALL_REDUCE, 0, FULL / 4)]),
        ((P, P), (S(0), R), [(REDUCE_SCATTER, 0, FULL), (ALL_REDUCE, 1, FULL / 2)]),
        # something sharded: inner axis first, so the all-reduce moves the gathered tensor
        ((P, S(1)), (R, R), [(ALL_GATHER, 1, FULL), (ALL_REDUCE, 0, FULL)]),
        # gather before all-to-all
        ((S(0), S(1)), (S(1), R), [(ALL_GATHER, 1, FULL / 2), (ALL_TO_ALL, 0, FULL / 2)]),
        # the inner S(0) is nested under nothing the target has: gathered, then cut again locally
        ((S(1), S(0)), (S(0), S(1)), [(ALL_GATHER, 1, FULL / 2), (ALL_TO_ALL, 0, FULL / 2)]),
        # S(d) -> P pads locally where d is sharded once, and gathers first where it is not
        ((S(0), S(1)), (S(0), P), []),
        ((S(0), S(0)), (S(0), P), [(ALL_GATHER, 1, FULL / 2)]),
        ((S(0), R), (S(0), P), []),
    ],
)
def test_reshard_steps_2d(src, dst, expected) -> None:
    steps = reshard_steps(src, dst, SHAPE, ITEM, (2, 4))
    assert [(s.kind, s.mesh_axis, s.nbytes) for s in steps] == expected


def test_reshard_size_one_axis_needs_nothing() -> None:
    assert reshard_steps((P, S(0)), (R, S(0)), SHAPE, ITEM, (1, 4)) == []


def test_reshard_rejects_mismatched_specs() -> None:
    with pytest.raises(ValueError):
        reshard_steps((R,), (R, R), SHAPE, ITEM, (2, 4))


def test_reshard_time_uses_each_axis_link() -> None:
    slow, fast = LinkSpec(1e9, 1e-5), LinkSpec(1e11, 1e-6)
    mesh = (2, 4)
    t = reshard_time((S(0), S(1)), (R, R), SHAPE, ITEM, mesh, (slow, fast))
    expected = collective_time(ALL_GATHER, FULL / 2, 4, fast) + collective_time(ALL_GATHER, FULL, 2, slow)
    assert t == pytest.approx(expected)
    steps = [CollectiveStep(ALL_REDUCE, 1, 1e6), CollectiveStep(ALL_GATHER, 0, 2e6)]
    assert steps_time(steps, mesh, (slow, fast)) == pytest.approx(
        collective_time(ALL_REDUCE, 1e6, 4, fast) + collective_time(ALL_GATHER, 2e6, 2, slow)
    )
    assert reshard_time((R, R), (R, R), SHAPE, ITEM, mesh, (slow, fast)) == 0


def test_reshard_steps_are_dtensors_own_plan() -> None:
    """For every pair of specs on a (2, 4) mesh, the collectives costed are those DTensor's
    redistribution planner runs, in its order (the emitted program redistributes with it, in
    two steps where partial sums are reduce-scattered first; the
    program reaches partial targets locally, so those pairs are checked with the partial
    axes replicated on DTensor's side). Runs DTensor's planner on a fake process group."""
    import itertools

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def dtensor(spec):
        return tuple(Replicate() if p.is_replicate else Partial() if p.is_partial else Shard(p.dim) for p in spec)

    shape, mesh_shape = (16, 16), (2, 4)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        meta = TensorMeta(torch.Size(shape), (16, 1), torch.float32)
        compared = 0
        for src, dst in itertools.product(itertools.product([R, P, S(0), S(1)], repeat=2), repeat=2):
            if not (is_valid(src, shape, mesh_shape) and is_valid(dst, shape, mesh_shape)):
                continue
            ours = reshard_steps(src, dst, shape, 4, mesh_shape)
            if any(t.is_partial and not c.is_partial for c, t in zip(src, dst)):
                continue  # made locally by the program, see reshard_steps
            # the program reduce-scatters first where the cost model does: two redistributions
            first = reduce_scatter_first(src, dst)
            mid = tuple(d if i in first else s for i, (s, d) in enumerate(zip(src, dst)))
            hops = [(src, mid), (mid, dst)] if first else [(src, dst)]
            infos = [info for a, b in hops for info in _gen_transform_infos_non_cached(
                DTensorSpec(mesh, dtensor(a), meta), DTensorSpec(mesh, dtensor(b), meta))]
            theirs = []
            for info in infos:
                a, b = info.src_dst_placements
                kind = (ALL_REDUCE if b.is_replicate() else REDUCE_SCATTER) if a.is_partial() else \
                    (ALL_GATHER if b.is_replicate() else ALL_TO_ALL) if a.is_shard() and not b.is_partial() else None
                if kind is not None:
                    theirs.append((kind, info.mesh_dim))
            assert [(s.kind, s.mesh_axis) for s in ours] == theirs, (src, dst)
            compared += 1
        assert compared >= 100
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Clusters: mesh links


def _cluster(dpn: int) -> ClusterSpec:
    return load_cluster("h100", devices_per_node=dpn)


@pytest.mark.parametrize(
    "mesh, dpn, expected",
    [
        ((2, 8), 8, ("inter", "intra")),
        ((8,), 8, ("intra",)),
        ((16,), 8, ("inter",)),
        ((4, 4), 8, ("inter", "intra")),
        ((2, 4), 4, ("inter", "intra")),
        ((4, 2), 4, ("inter", "intra")),
        ((2, 4), 8, ("intra", "intra")),
        ((1, 16), 8, ("intra", "inter")),
        # not powers of two
        ((2, 3), 3, ("inter", "intra")),
        ((3, 2), 6, ("intra", "intra")),
        ((3, 4), 6, ("inter", "inter")),  # axis 1 group {4,5,6,7} straddles nodes 0 and 1
        ((2, 3, 2), 6, ("inter", "intra", "intra")),
        ((6,), 4, ("inter",)),
    ],
)
def test_mesh_links(mesh, dpn, expected) -> None:
    cluster = _cluster(dpn)
    names = {cluster.intra_node: "intra", cluster.inter_node: "inter"}
    assert tuple(names[link] for link in cluster.mesh_links(mesh)) == expected


# ---------------------------------------------------------------------------------------------
# Presets, TOML, overrides


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_loads(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster == load_cluster(name.upper())
    assert cluster.device.memory_bytes > 0 and cluster.device.memory_bandwidth > 0
    assert cluster.intra_node.bandwidth >= cluster.inter_node.bandwidth
    assert cluster.devices_per_node == (64 if name == "cpu" else 8)


def test_preset_figures() -> None:
    h100 = load_cluster("h100")
    assert h100.device.peak("bfloat16") == 989e12
    assert h100.device.peak("torch.bfloat16") == 989e12
    assert h100.device.peak("int64") == 67e12  # unknown dtype: the float32 peak
    assert h100.intra_node == LinkSpec(450e9, 3e-6) and h100.inter_node == LinkSpec(50e9, 10e-6)
    assert load_cluster("h200").device.memory_bytes == 141e9
    assert load_cluster("a100-40g").device.memory_bandwidth == 1.555e12
    v100 = load_cluster("v100-16g").device
    assert v100.peak("bfloat16") == v100.peak("float32") == 15.7e12
    assert v100.peak("float16") == 125e12


def test_preset_table_is_fresh() -> None:
    table = preset_table()
    table.clear()
    assert set(preset_table()) == set(PRESET_NAMES)


def test_device_spec_is_frozen_and_owns_its_peaks() -> None:
    peaks = {"float32": 1e12}
    dev = DeviceSpec("x", peaks, 1e12, 1e9)
    peaks["float32"] = 5.0
    assert dev.peak("float32") == 1e12
    assert hash(dev) == hash(DeviceSpec("x", {"float32": 1e12}, 1e12, 1e9))
    with pytest.raises(Exception):
        dev.name = "y"  # type: ignore[misc]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_toml_round_trip(tmp_path: Path, name: str) -> None:
    cluster = load_cluster(name)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster.to_toml())
    assert load_cluster(str(path)) == cluster


def test_toml_round_trip_odd_numbers(tmp_path: Path) -> None:
    cluster = ClusterSpec(
        "odd name \"quoted\"",
        DeviceSpec("dev", {"float32": 1.234567e13, "bfloat16": 3.3e14, "float8_e4m3fn": 1.1e15}, 1.1e12, 23.7e9),
        6,
        LinkSpec(123.456e9, 2.5e-6),
        LinkSpec(3.125e9, 0.0),
    )
    path = tmp_path / "odd.toml"
    path.write_text(cluster.to_toml())
    assert load_cluster(str(path)) == cluster


def test_dict_round_trip_through_json() -> None:
    for name in PRESET_NAMES:
        cluster = load_cluster(name)
        assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


def test_toml_preset_override(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "mine"\npreset = "H100"\n'
        "[device]\nmemory_gb = 40\n"
        "[device.peak_tflops]\nbfloat16 = 500\n"
        "[inter_node]\nbandwidth_gbps = 100\n"
    )
    cluster = load_cluster(str(path))
    h100 = load_cluster("h100")
    assert cluster.name == "mine"
    assert cluster.device.memory_bytes == 40e9
    assert cluster.device.peak("bfloat16") == 500e12
    assert cluster.device.peak("float32") == 67e12  # kept from the preset
    assert cluster.device.memory_bandwidth == h100.device.memory_bandwidth
    assert cluster.inter_node == LinkSpec(100e9, 10e-6)
    assert cluster.intra_node == h100.intra_node
    assert cluster.devices_per_node == 8


def test_load_overrides() -> None:
    cluster = load_cluster("a100-80g", devices_per_node=4, memory_per_device=40e9)
    assert cluster.devices_per_node == 4
    assert cluster.device.memory_bytes == 40e9
    assert cluster.device.peak("bfloat16") == 312e12
    with pytest.raises(AutoplanError) as exc:
        load_cluster("h100", devices_per_node=0)
    single_line(exc)
    with pytest.raises(AutoplanError):
        load_cluster("h100", memory_per_device=-1)


def test_unknown_cluster_message() -> None:
    with pytest.raises(AutoplanError) as exc:
        load_cluster("h10")
    text = single_line(exc)
    assert "'h10'" in text
    for name in PRESET_NAMES:
        assert name in text
    with pytest.raises(AutoplanError):
        load_cluster("no/such/file.toml")


def test_broken_toml_message(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\ndevices_per_node = \n[device\n')
    with pytest.raises(AutoplanError) as exc:
        load_cluster(str(path))
    assert str(path) in single_line(exc)


@pytest.mark.parametrize(
    "text, key",
    [
        # no preset, so every key is required
        (
            'name = "x"\ndevices_per_node = 8\n[device]\nmemory_bandwidth_gbps = 1\n'
            "[device.peak_tflops]\nfloat32 = 1\n"
            "[intra_node]\nbandwidth_gbps = 1\nlatency_us = 1\n[inter_node]\nbandwidth_gbps = 1\nlatency_us = 1\n",
            "device.memory_gb",
        ),
        ('name = "x"\ndevices_per_node = 8\n', "device"),
        ('preset = "h100"\n[inter_node]\nlatency_us = "fast"\n', "inter_node.latency_us"),
        ('preset = "h100"\n[device]\nmemory_gb = -3\n', "device.memory_gb"),
        ('preset = "h100"\ndevices_per_node = 0\n', "devices_per_node"),
        ('preset = "h100"\n[device]\nmemory_gib = 3\n', "device.memory_gib"),
        ('preset = "h1000"\n', "preset"),
    ],
)
def test_bad_toml_names_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(AutoplanError) as exc:
        load_cluster(str(path))
    message = single_line(exc)
    assert str(path) in message
    assert f"'{key}'" in message


# ---------------------------------------------------------------------------------------------
# Memory sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GB", 40 * 10**9),
        ("40GiB", 40 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1TB", 10**12),
        ("1.5GB", 1_500_000_000),
        ("38 GiB", 38 * 2**30),
        ("40gb", 40 * 10**9),
        ("1024", 1024),
    ],
)
def test_parse_memory_size(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["40 gigs", "", "GB", "-1GB", "1.5", "40GBB", "4e9"])
def test_parse_memory_size_rejects(text: str) -> None:
    with pytest.raises(AutoplanError) as exc:
        parse_memory_size(text)
    message = single_line(exc)
    assert repr(text) in message and "40GB" in message


# ---------------------------------------------------------------------------------------------
# Compute and memory


def test_roofline_picks_the_bound() -> None:
    dev = DeviceSpec("d", {"float32": 1e12, "bfloat16": 4e12}, memory_bandwidth=1e11, memory_bytes=1e9)
    assert roofline_time(1e12, 1e9, dev, "float32") == pytest.approx(1.0)  # compute bound
    assert roofline_time(1e12, 1e9, dev, "bfloat16") == pytest.approx(0.25)
    assert roofline_time(1e9, 1e11, dev, "float32") == pytest.approx(1.0)  # memory bound
    assert roofline_time(1e12, 1e9, dev, "torch.bfloat16") == pytest.approx(0.25)


def test_op_bandwidth_is_the_memory_term_and_defaults_to_the_memory_bandwidth() -> None:
    plain = DeviceSpec("d", {"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=1e9)
    assert plain.op_bandwidth == 0.0 and plain.activation_bandwidth == 1e11
    measured = DeviceSpec("d", {"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=1e9, op_bandwidth=5e10)
    assert measured.activation_bandwidth == 5e10
    assert roofline_time(1e9, 1e11, measured, "float32") == pytest.approx(2.0)  # memory bound at the op rate
    assert roofline_time(1e12, 1e9, measured, "float32") == pytest.approx(1.0)  # compute bound: unchanged
    assert load_cluster("cpu").device.activation_bandwidth == load_cluster("cpu").device.memory_bandwidth
    for name in PRESET_NAMES[:-1]:  # a GPU's ops reach 0.9 of the streaming bandwidth (measured on an H200)
        dev = load_cluster(name).device
        assert dev.activation_bandwidth == pytest.approx(0.9 * dev.memory_bandwidth)


def test_gpu_presets_cost_ops_at_what_a_gpu_achieves() -> None:
    """Matmuls at 0.78 of the datasheet peak (the peak itself stays, for model FLOPs
    utilisation); no dispatch charged (it depends on the host: a calibrated file carries it)."""
    dev = load_cluster("h100").device
    assert dev.peak("bfloat16") == 989e12 and dev.achievable("bfloat16") == pytest.approx(0.78 * 989e12)
    assert roofline_time(989e12, 0.0, dev, "bfloat16") == pytest.approx(1 / 0.78)
    assert dev.op_overhead_s == 0 and cm.op_seconds(1e-6, dev) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceSpec("d", {"float32": 1e12}, 1e11, 1e9, matmul_efficiency=1.5)


def test_a_file_with_its_own_peaks_takes_them_as_achieved(tmp_path: Path) -> None:
    """A file from a GPU preset keeps its fractions of the datasheet figures, unless it gives
    its own peaks or bandwidth (measured ones, as ``results/h100-measured-matmul.toml``)."""
    path = tmp_path / "c.toml"
    path.write_text('preset = "h100"\n[device]\nmemory_gb = 96\n')
    kept = load_cluster(str(path)).device
    assert kept.matmul_efficiency == 0.78 and kept.op_bandwidth == pytest.approx(0.9 * 3.35e12)
    path.write_text('preset = "h100"\n[device]\nmemory_bandwidth_gbps = 3012\n[device.peak_tflops]\nbfloat16 = 776.5\n')
    measured = load_cluster(str(path)).device
    assert measured.matmul_efficiency == 1.0 and measured.activation_bandwidth == 3012e9
    assert measured.achievable("bfloat16") == 776.5e12
    path.write_text('preset = "h100"\n[device]\nmatmul_efficiency = 0.5\n[device.peak_tflops]\nbfloat16 = 800\n')
    assert load_cluster(str(path)).device.achievable("bfloat16") == 400e12
    path.write_text('preset = "h100"\n[device]\nmatmul_efficiency = 1.5\n')
    with pytest.raises(AutoplanError, match="device.matmul_efficiency.*fraction"):
        load_cluster(str(path))


def test_op_bandwidth_round_trips_and_presets_write_no_key(tmp_path: Path) -> None:
    assert "op_bandwidth" not in load_cluster("cpu").to_toml()
    gpu = load_cluster("h200")
    (tmp_path / "h200.toml").write_text(gpu.to_toml())
    assert load_cluster(str(tmp_path / "h200.toml")).device == gpu.device  # efficiency and op rate kept
    dev = DeviceSpec("cpu", {"float32": 1.6e11}, 1.4e10, 12e9, op_overhead_s=5.2e-5, op_bandwidth=3.4e9)
    cluster = ClusterSpec("c", dev, 2, LinkSpec(6e8, 7e-4), LinkSpec(6e8, 7e-4))
    text = cluster.to_toml()
    assert "op_bandwidth_gbps = 3.4" in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_cluster(str(path)) == cluster
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    path.write_text(text.replace("op_bandwidth_gbps = 3.4", "op_bandwidth_gbps = -1"))
    with pytest.raises(AutoplanError, match="device.op_bandwidth_gbps"):
        load_cluster(str(path))


def test_per_kind_link_rates_round_trip_and_cost_each_kind(tmp_path: Path) -> None:
    ar, rs = cm.LinkRates(2e9, 5e-5), cm.LinkRates(1e9, 3e-4)
    link = LinkSpec(1.5e9, 1e-4, (("all_reduce", ar), ("reduce_scatter", rs)))
    cluster = ClusterSpec("c", load_cluster("cpu").device, 4, link, LinkSpec(1e9, 1e-4))
    text = cluster.to_toml()
    assert "[intra_node.reduce_scatter]" in text and "[inter_node.all_reduce]" not in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_cluster(str(path)) == cluster
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    # each kind pays its own rates; a kind without its own pays the link's
    assert cm.collective_time("all_reduce", 4e6, 4, link) == pytest.approx(1.5 * 4e6 / 2e9 + 6 * 5e-5)
    assert cm.collective_time("reduce_scatter", 4e6, 4, link) == pytest.approx(0.75 * 4e6 / 1e9 + 3 * 3e-4)
    assert cm.collective_time("all_gather", 4e6, 4, link) == pytest.approx(0.75 * 4e6 / 1.5e9 + 3 * 1e-4)
    quiet = link.without_latency()
    assert cm.collective_time("reduce_scatter", 4e6, 4, quiet) == pytest.approx(0.75 * 4e6 / 1e9)
    # a preset's link keeps its other kinds when a file overrides one
    path.write_text('preset = "cpu"\n[intra_node.all_gather]\nlatency_us = 7\n')
    read = load_cluster(str(path)).intra_node
    base = load_cluster("cpu").intra_node
    assert read.rates("all_gather") == cm.LinkRates(base.bandwidth, 7e-6)
    assert read.rates("all_reduce") == cm.LinkRates(base.bandwidth, base.latency)
    path.write_text('preset = "cpu"\n[intra_node.gather]\nlatency_us = 7\n')
    with pytest.raises(AutoplanError, match="intra_node.gather"):
        load_cluster(str(path))


def test_backward_factor_is_the_planners_default() -> None:
    from autoplan.cost_models.step_costs import CostContext

    ctx = CostContext((1,), (LinkSpec(1e9, 0.0),), load_cluster("cpu").device, OptimizerSpec())
    assert ctx.backward_factor == cm.BACKWARD_FACTOR


def test_views_move_no_bytes() -> None:
    from autoplan.cost_models.step_costs import moved_bytes
    from autoplan.trace.graph import NodeInfo

    def node(target: str) -> NodeInfo:
        return NodeInfo("n", "op", target, (8, 8), "float32", 4, 0.0, 512.0, "", "", ())

    for target in ("aten.view.default", "aten.transpose.int", "aten.split.Tensor", "aten.t.default"):
        assert moved_bytes(node(target)) == 0.0
    for target in ("aten.add.Tensor", "aten.gelu.default", "aten.clone.default", "aten.contiguous.default"):
        assert moved_bytes(node(target)) == 512.0


def test_mixed_precision_computes_at_the_bf16_peak_and_keeps_half_the_bytes() -> None:
    """Under mixed precision a float32 op runs at the bfloat16 peak and its output is kept in 2
    bytes; a parameter's own size (float32 master, float32 gradient reduction) stays."""
    from autoplan.cost_models.step_costs import CostContext, op_cost, storage_cost, value_itemsize
    from autoplan.strategies.candidates import replicated_strategy
    from autoplan.trace.graph import NodeInfo

    device = load_cluster("h100").device
    matmul = NodeInfo("mm", "op", "aten.mm.default", (4096, 4096), "float32", 4, 2 * 4096.0 ** 3, 3 * 4 * 4096.0 ** 2,
                      "", "", ())
    weight = NodeInfo("w", "parameter", "", (4096, 4096), "float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    strategy = replicated_strategy(2, 1, 1)
    costs = {}
    for mixed in (False, True):
        ctx = CostContext((1,), (LinkSpec(1e9, 0.0),), device, OptimizerSpec("adamw", mixed_precision=mixed))
        costs[mixed] = op_cost(matmul, strategy, [weight, weight], [True, True], True, True, ctx)
        assert value_itemsize(weight, mixed) == 4
    assert value_itemsize(matmul, True) == 2 and value_itemsize(matmul, False) == 4
    assert costs[True].memory.activations == costs[False].memory.activations / 2
    ratio = device.peak("float32") / device.peak("bfloat16")
    assert costs[True].compute_s == pytest.approx(costs[False].compute_s * ratio, rel=0.05)
    ctx = CostContext((1,), (LinkSpec(1e9, 0.0),), device, OptimizerSpec("adamw", mixed_precision=True))
    # the fp32 master and autocast's bf16 copy, which the consumer keeps for its backward
    assert storage_cost(weight, (R,), ctx, trainable=True).memory.params == (4 + 2) * 4096 ** 2


def test_optimizer_state_bytes() -> None:
    assert OptimizerSpec("adam").state_bytes_per_param(4) == (4, 4, 8)
    mixed = OptimizerSpec("adam", mixed_precision=True)  # fp32 master, gradient and moments under autocast
    assert mixed.state_bytes_per_param(4) == (4, 4, 8) and mixed.compute_copy_bytes == 2
    assert sum(mixed.state_bytes_per_param(4)) == 16 and OptimizerSpec("adam").compute_copy_bytes == 0
    assert OptimizerSpec("sgd").state_bytes_per_param(4) == (4, 4, 0)
    assert OptimizerSpec("sgd-momentum").state_bytes_per_param(4) == (4, 4, 4)
    assert OptimizerSpec("AdamW") == OptimizerSpec("adamw")
    with pytest.raises(AutoplanError) as exc:
        OptimizerSpec("lion")
    single_line(exc)


def test_optimizer_step_time() -> None:
    dev = load_cluster("h100").device
    t = optimizer_step_time(1e9, dev, OptimizerSpec("adam"), 4)
    assert t == pytest.approx(1e9 * (2 * 4 + 4 + 2 * 8) / 3.35e12)
    t_mixed = optimizer_step_time(1e9, dev, OptimizerSpec("adam", mixed_precision=True), 4)
    assert t_mixed == pytest.approx(t)  # the same fp32 master, gradient and moments


def test_package_does_not_import_torch() -> None:
    package = Path(cm.__file__).parent
    for source in package.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), source.name


def test_dispatch_overlaps_compute_on_gpus_and_adds_on_cpus(tmp_path: Path) -> None:
    serial = DeviceSpec("cpu", {"float32": 1e11}, 1e10, 1e9, op_overhead_s=1e-4)
    overlapped = DeviceSpec("gpu", {"float32": 1e11}, 1e10, 1e9, op_overhead_s=1e-4, overlapped_dispatch=True)
    assert cm.op_seconds(3e-4, serial) == pytest.approx(4e-4)
    assert cm.op_seconds(3e-4, overlapped) == pytest.approx(3e-4)  # the kernel outlasts its dispatch
    assert cm.op_seconds(2e-5, overlapped) == pytest.approx(1e-4)  # the device waits for the host
    assert load_cluster("h100").device.overlapped_dispatch and not load_cluster("cpu").device.overlapped_dispatch
    cluster = ClusterSpec("g", overlapped, 8, LinkSpec(1e11, 1e-6), LinkSpec(1e10, 1e-5))
    path = tmp_path / "g.toml"
    path.write_text(cluster.to_toml())
    assert "overlapped_dispatch = true" in path.read_text()
    assert load_cluster(str(path)) == cluster
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    path.write_text('preset = "h100"\n[device]\noverlapped_dispatch = "yes"\n')
    with pytest.raises(AutoplanError, match="device.overlapped_dispatch"):
        load_cluster(str(path))
    path.write_text('preset = "h100"\n[device]\nop_overhead_us = 100\n')  # a GPU preset's device overlaps
    assert load_cluster(str(path)).device.overlapped_dispatch
