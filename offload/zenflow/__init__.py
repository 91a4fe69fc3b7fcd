"""``zenflow`` mode: important columns on the device every step, the rest on the CPU in the background.

Parameters. A 2-D weight with ``k = ceil(topk_ratio * cols) < cols`` is *split*: its selected
columns (:mod:`offload.selection`) are updated on the device every step by
:class:`~offload.zenflow.selective_adamw.SelectiveAdamW`; the whole weight also lives on the host
(fp32 master, fp32 moments, :class:`~offload.host.HostStore`; :mod:`offload.zenflow.layout`).
Everything else (1-D params, and 2-D weights whose every column is selected, e.g. ``topk_ratio=1``)
is owned by the device optimizer outright.

Windows. Steps are grouped into windows ``v = 1, 2, ...`` of ``update_interval`` steps (or "adaptive",
below); the selection ``S_v`` is fixed within a window. Every step, after global clipping:

1. the device updates the selected columns (and the device-only params);
2. the CPU thread adds the split params' whole gradients into the window's host accumulator
   (:mod:`offload.zenflow.accumulation`: ``bufs[v % 2]``, the window *mean* in the parameters'
   dtype, streamed off the device through a two-slot page-locked ring on CUDA; with
   ``accumulate_on="device"`` an fp32 device accumulator instead, copied to the host once, at the
   boundary).

At the boundary ending window ``v`` the training thread (:mod:`offload.zenflow.window`):

a. waits for ``R_{v-1}``, the CPU AdamW result of the previous window (the only possible stall),
   and merges it into the device weights except the columns in ``S_{v-1} | S_v`` (union), where the device
   value wins (the device updated them, or the CPU result for them is void). ``S_{v-1}`` is the
   selection window ``v - 1`` ran under, not the one chosen at its end: a column dropped there was
   the device's, and the CPU master only gets its value in (b), after ``R_{v-1}`` was computed;
b. writes into the CPU master the stashed device values of the columns dropped from the selection
   at the previous boundary (the device was authoritative for them; this must wait for ``R_{v-1}``;
   :mod:`offload.zenflow.handover`);
c. reselects if due (``select_interval`` steps since the last selection; "epoch": when the caller
   called ``new_epoch()``, or every ``select_interval_fallback`` steps if it never does), every
   split weight batched with fixed shapes on the device. Columns that stay keep their device
   moments; new columns start at zero moments, step 0, their fp32 device master taken from the CPU
   master (one blocking read of the new columns for all bf16/fp16 weights together: the only host
   sync of a reselection; none for fp32; gathered in transient host memory); the old columns' newest
   fp32 values and which of them were dropped stay on the device until (b) copies them to the host;
d. submits AdamW on the window's mean gradient to the CPU thread: one CPU step per window, at the lr
   current at the boundary (default, gradient-accumulation semantics, as DeepSpeed's ZenFlow) or with
   ``scale_cpu_lr`` at the sum of the learning rates of the window's steps (the linear scaling rule;
   it converges worse, see ``EngineConfig.scale_cpu_lr``).
   The CPU step writes the new bf16/fp16 parameters over the accumulator it read (fp32: the master
   is the result). On CUDA the CPU thread then prefetches the result into device landing buffers on
   the H2D stream, so (a) at the next boundary is a device-to-device copy (``landing_buffers=False``:
   no such device copy; (a) uploads from host memory then). Host bytes per split element: 12 + 2
   accumulators (or 1 with device accumulation), in bf16 for bf16 parameters and in fp32 for fp16
   ones (fp16 gradients stay loss-scaled, and a window's sum of them would lose its small entries in
   fp16), see :mod:`offload.memory`.

So the unimportant weights are exactly one window stale: the update from window ``v``'s gradients
reaches the model at the end of window ``v + 1``. With ``overlap_step=False`` the boundary instead
waits for window ``v``'s CPU step and applies it at once (no staleness, the CPU step is stall). A
column that becomes selected loses the CPU update of the window it was selected in (the device takes
over from its value at that boundary).

"adaptive" window length: a window ends when the summed squared norm of the unselected gradient over
the window reaches the mean squared norm of the selected gradient per step, i.e. when the update
waiting on the CPU weighs as much as one step of what the device applies; at most
``max_update_interval`` steps. The two norms leave the device in a non-blocking copy queued before
the optimizer's kernels and are read after those are queued (no host sync per step). Warm-up: the
first ``full_warm_up_rounds`` steps update the split params synchronously on the CPU (offload style)
and select nothing.

Skipped steps (:mod:`offload.guard`): the device part is gated on the device; the host learns the
verdict once the step's device work is queued and then neither accumulates the step's gradient nor
counts it (window length, its learning rates, steps since the selection, warm-up rounds). A skipped
first step leaves nothing selected, so the next step selects afresh.

In a process group the split weights' gradients are reduce-scattered where only the host needs them
(:mod:`offload.zenflow.reduction`). The modules: :mod:`~offload.zenflow.mode` (the step
orchestration and the window schedule), :mod:`~offload.zenflow.layout`,
:mod:`~offload.zenflow.accumulation`, :mod:`~offload.zenflow.window`,
:mod:`~offload.zenflow.handover`, :mod:`~offload.zenflow.reduction`; the device optimizer
:mod:`~offload.zenflow.selective_adamw` over :mod:`~offload.zenflow.column_groups` and its arithmetic,
:mod:`~offload.zenflow.adamw`.
"""
