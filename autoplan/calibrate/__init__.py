"""``autoplan calibrate --devices N -o FILE``: measure this machine, write a cluster TOML file.

Modules: :mod:`results` (settings and what was measured), :mod:`worker` (one process's
measurements), :mod:`measure` (running the processes), :mod:`fit` (the alpha-beta and
op-bandwidth fits, and the checks that refuse implausible fits), :mod:`cluster_file` (the
cluster and its TOML, written with ``tomli_w``), :mod:`command` (the command line).

Everything is measured by N worker processes at once (``torch.multiprocessing`` spawn, a
FileStore rendezvous, one process even for N = 1), so that each process ("device") sees the
share of the machine it has when ``torchrun --nproc-per-node N`` runs the emitted train.py:

- on CPUs each process uses the intra-op threads torchrun gives it: ``OMP_NUM_THREADS`` when
  set, else 1 thread when N > 1 (torchrun's default) and torch's default for N = 1;
- a CPU timing is the mean over a window of back-to-back calls lasting at least
  ``cpu_window_s`` (several scheduler time slices), so that when N processes share fewer cores
  the time each loses to the others is in it (timing single calls would leave it out: a short
  call rarely loses the CPU, a training step always does). CUDA calls are timed one by one with
  CUDA events after synchronising.

Each figure is the median of repeats after warm-up, the slowest rank's:

- matmul throughput per dtype (float32, bfloat16, float16; CPU bf16/fp16 may be slow, and is
  then measured on a smaller shape), square and skinny shapes; the dtype's peak is the best
  shape's median;
- memory bandwidth: a large ``copy_`` (2·B bytes moved) and ``add`` (3·B), the better of the two
  (streaming; the optimizer step's rate);
- per-op overhead: a training step (forward + backward) of a tiny transformer block (shapes so
  small that dispatch is all there is) run as the DTensor program autoplan emits, on a
  one-device mesh per process (no collective in it), divided by the op passes the cost model
  charges (every op node once forward and ``BACKWARD_FACTOR`` times backward); the same for the
  plain eager module is written as a comment;
- op bandwidth: a training step of the same block at activation sizes (``cpu_block``), run the
  same way; ``device.op_bandwidth`` is the rate of the ops' memory traffic at which the cost
  model (:func:`autoplan.cost_models.step_costs.op_cost`: matmuls at the float32 peak, the overhead
  above) predicts that measured time (:func:`fit_op_bandwidth`). Microbenchmarks of single ops
  miss what a step's backward adds to its traced forward ops (the ``cat`` behind a ``split``,
  copies of transposed gradients, bias-gradient sums, accumulation), the attention kernels'
  own traffic and the caches' state; the fit puts them where the cost model can charge them;
- with N > 1, the collectives all_reduce, all_gather, reduce_scatter and all_to_all as the
  emitted programs run them: a DTensor ``redistribute`` (Partial → Replicate, Shard → Replicate,
  Partial → Shard, Shard(0) → Shard(1)), gloo on CPUs and NCCL on GPUs, over message sizes from
  a few KiB (latency) to MiBs (bandwidth). On CPUs each collective follows ``cpu_filler_s`` of
  compute (small matmuls, whose own time is subtracted), as in a training step, where ranks
  drift apart between collectives and a waiting rank sleeps and must be woken; back-to-back
  collectives would hide that. The drift grows with the compute before the collective and
  levels off after a few scheduler time slices: with 4 processes on 2 cores, a small all-reduce
  cost 5.7 ms after 1 ms of compute, 7.6 ms after 4 ms, 8.2 after 18 and 9.3 after 72 (2
  processes: 1.2, 1.8, 3.6 and 3.0 ms). A collective the backend cannot run is skipped and
  named in the file.

The timings are fitted to the alpha-beta ring model of
:mod:`autoplan.cost_models.communication` (``t = latency_steps·α + bytes_moved_per_device/bw``)
by least squares on relative errors (:func:`fit_alpha_beta`): one fit per collective, written
as the ``intra_node`` link's rates for that kind (``[intra_node.all_reduce]``, ...: the kinds'
latencies differ by 2x on gloo), and one joint fit over all of them, the link's own rates (what
a kind without its own fit, such as send_recv, gets). One machine is one
node: ``devices_per_node = N``; ``inter_node`` is not measured and keeps the preset's link
(capped at the measured intra-node one), as a comment in the file says. N = 1 leaves the links
at the preset's.
"""

from autoplan.calibrate.cluster_file import calibration_cluster, calibration_toml
from autoplan.calibrate.command import add_calibrate_arguments, run_calibrate, run_calibrate_args
from autoplan.calibrate.fit import LinkFit, Sample, fit_alpha_beta, fit_op_bandwidth
from autoplan.calibrate.measure import calibrate, resolve_backend
from autoplan.calibrate.results import DRIFT_WARNING, MEASURED_COLLECTIVES, CalibrateSettings, Calibration

__all__ = [
    "DRIFT_WARNING",
    "MEASURED_COLLECTIVES",
    "CalibrateSettings",
    "Calibration",
    "LinkFit",
    "Sample",
    "add_calibrate_arguments",
    "calibrate",
    "calibration_cluster",
    "calibration_toml",
    "fit_alpha_beta",
    "fit_op_bandwidth",
    "resolve_backend",
    "run_calibrate",
    "run_calibrate_args",
]
