"""Python binding of libr2ccl-snapshot (ctypes; no compiled extension).

    from r2ccl_snapshot import Snapshot
    snap = Snapshot(rank, world)                   # socket: R2CCL_SNAPSHOT_SOCKET or the board's
    snap.register_torch_module(model, optimizer)   # after one optimizer step (state must exist)
    for step in ...:
        train_step()
        snap.set_loss_scale(scaler.get_scale())    # optional
        snap.capture_torch_rng()                   # optional: torch's CPU RNG state
        stats = snap.take(step)                    # copies, returns; encoding runs in background
    # after a failure (a replacement process opens with the lost rank's id):
    step = snap.restore()

The library is found through R2CCL_SNAPSHOT_LIB (a path), next to this module, at
../../../lib (the install tree: share/r2ccl/python), in ../../build*/lib (a source checkout), or
by the loader's search path. Tensors and arrays must be contiguous and stay alive: the binding
keeps a reference to every registered object. Errors raise SnapshotError (.code, .name); a
timeout raises SnapshotTimeout (a subclass). Threads: take/restore/register/flush from the
training thread; state/wait_event/kv_* from any thread (ctypes releases the GIL during calls).
"""

import ctypes
import glob
import os
import socket as _socket

__all__ = ["Snapshot", "SnapshotError", "SnapshotTimeout", "reinit_process_group",
           "remap_rank", "load_library"]

OK = 0
ERR_TIMEOUT = -5
ERR_TOO_SMALL = -11
DTYPE_BYTES, DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2, 3
CODEC_LOSSLESS, CODEC_LOSSY = 0, 1
FLAG_DEVICE = 1
MAX_RNG_BYTES = 65536
MAX_KV_VALUE = 4096
MAX_NODES = 1024
CHANGED_EPOCH, CHANGED_COMPLETE = 1, 2


class SnapshotError(RuntimeError):
    """A failed r2ccl_snap_* call: .code (negative int), .name (R2CCL_SNAP_ERR_*)."""

    def __init__(self, code, name, message):
        super().__init__("%s (%s)" % (message, name))
        self.code = code
        self.name = name


class SnapshotTimeout(SnapshotError):
    pass


class _TakeStats(ctypes.Structure):
    _fields_ = [("skipped", ctypes.c_int), ("step", ctypes.c_uint64),
                ("copy_seconds", ctypes.c_double), ("wait_seconds", ctypes.c_double),
                ("prev_valid", ctypes.c_int), ("prev_step", ctypes.c_uint64),
                ("prev_encode_seconds", ctypes.c_double), ("prev_send_seconds", ctypes.c_double),
                ("prev_raw_bytes", ctypes.c_uint64), ("prev_encoded_bytes", ctypes.c_uint64),
                ("prev_ratio", ctypes.c_double), ("prev_max_abs_error", ctypes.c_double),
                ("prev_base_buffers", ctypes.c_uint32)]


class _State(ctypes.Structure):
    _fields_ = [("epoch", ctypes.c_uint64), ("node_id", ctypes.c_uint32),
                ("n_nodes", ctypes.c_uint32), ("member_count", ctypes.c_uint32),
                ("has_complete_step", ctypes.c_int), ("complete_step", ctypes.c_uint64),
                ("members", ctypes.c_uint64 * (MAX_NODES // 64)), ("changes", ctypes.c_uint32),
                ("states_received", ctypes.c_uint64)]


_lib = None


def _candidates():
    env = os.environ.get("R2CCL_SNAPSHOT_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libr2ccl-snapshot.so")
    yield os.path.normpath(os.path.join(here, "..", "..", "..", "lib", "libr2ccl-snapshot.so"))
    for p in sorted(glob.glob(os.path.join(here, "..", "..", "build*", "lib",
                                           "libr2ccl-snapshot.so"))):
        yield os.path.normpath(p)
    yield "libr2ccl-snapshot.so"  # the loader's search path


def load_library():
    """Loads libr2ccl-snapshot.so once (see the module docstring for where it is looked for)."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(path + ": not found")
            continue
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    else:
        raise OSError("libr2ccl-snapshot.so not found (set R2CCL_SNAPSHOT_LIB to its path); "
                      "tried: " + "; ".join(errors))
    vp, u32, u64, i64, sz = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64,
                             ctypes.c_size_t)
    sigs = {
        "r2ccl_snap_open": [ctypes.c_char_p, u32, u32, ctypes.POINTER(vp)],
        "r2ccl_snap_register": [vp, u32, vp, sz, ctypes.c_int, ctypes.c_int, u32],
        "r2ccl_snap_set_loss_scale": [vp, ctypes.c_double],
        "r2ccl_snap_get_loss_scale": [vp, ctypes.POINTER(ctypes.c_double)],
        "r2ccl_snap_set_rng_state": [vp, ctypes.c_char_p, sz],
        "r2ccl_snap_get_rng_state": [vp, vp, sz, ctypes.POINTER(sz)],
        "r2ccl_snap_take": [vp, u64, ctypes.POINTER(_TakeStats)],
        "r2ccl_snap_flush": [vp, i64],
        "r2ccl_snap_state": [vp, ctypes.POINTER(_State)],
        "r2ccl_snap_wait_event": [vp, i64, ctypes.POINTER(_State)],
        "r2ccl_snap_restore": [vp, i64, ctypes.POINTER(u64)],
        "r2ccl_snap_kv_put": [vp, ctypes.c_char_p, ctypes.c_char_p, sz],
        "r2ccl_snap_kv_get": [vp, ctypes.c_char_p, vp, sz, ctypes.POINTER(sz), i64],
    }
    sigs["r2ccl_snap_recovery_hint"] = [ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)]
    sigs["r2ccl_snap_log_recovered"] = [ctypes.c_char_p, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_char_p),
                                        ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, sz]
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = ctypes.c_int
    lib.r2ccl_snap_close.argtypes = [vp]
    lib.r2ccl_snap_close.restype = None
    lib.r2ccl_snap_last_error.argtypes = [vp]
    lib.r2ccl_snap_last_error.restype = ctypes.c_char_p
    lib.r2ccl_snap_strerror.argtypes = [ctypes.c_int]
    lib.r2ccl_snap_strerror.restype = ctypes.c_char_p
    _lib = lib
    return lib


def _check(lib, rc):
    if rc == OK:
        return
    msg = lib.r2ccl_snap_last_error(None).decode(errors="replace")
    name = lib.r2ccl_snap_strerror(rc).decode()
    raise (SnapshotTimeout if rc == ERR_TIMEOUT else SnapshotError)(rc, name, msg)


def _us(timeout_s):
    return -1 if timeout_s is None else int(max(0.0, timeout_s) * 1e6)


def _describe(obj):
    """(pointer, bytes, dtype code, device flag) of a numpy array or a torch tensor."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous (register a .contiguous() copy you keep "
                             "updating, or make the parameter contiguous)")
        dt = {torch.float32: DTYPE_F32, torch.float16: DTYPE_F16,
              torch.bfloat16: DTYPE_BF16}.get(obj.dtype, DTYPE_BYTES)
        nbytes = obj.numel() * obj.element_size()
        flags = FLAG_DEVICE if obj.is_cuda else 0
        if obj.device.type not in ("cpu", "cuda"):
            raise ValueError("tensor on device %s (accepted: cpu, cuda)" % obj.device)
        return obj.data_ptr(), nbytes, dt, flags
    import numpy as np
    if not isinstance(obj, np.ndarray):
        raise TypeError("register: a numpy array or a torch tensor, not %s" % type(obj).__name__)
    if not obj.flags["C_CONTIGUOUS"] or not obj.flags["WRITEABLE"]:
        raise ValueError("array must be C-contiguous and writeable (restore writes into it)")
    dt = {np.dtype(np.float32): DTYPE_F32, np.dtype(np.float16): DTYPE_F16}.get(obj.dtype,
                                                                             DTYPE_BYTES)
    return obj.ctypes.data, obj.nbytes, dt, 0


class Snapshot:
    """One training process's connection to its node's r2ccl_snapshotd."""

    def __init__(self, rank, world, socket=None):
        self._lib = load_library()
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.r2ccl_snap_open(
            socket.encode() if socket else None, rank, world, ctypes.byref(h)))
        self._h = h
        self.rank, self.world = rank, world
        self._refs = []    # registered objects, kept alive
        self.names = []    # name (or str(id)) of every buffer id

    # ---- buffers ----
    def register(self, name_or_id, tensor, lossy=False):
        """Registers a numpy array or torch tensor (contiguous; a CUDA tensor needs a USE_CUDA
        build) as the next buffer id; an int name must equal that id. lossy: FP16/BF16 only.
        Returns the id."""
        bid = len(self._refs)
        if isinstance(name_or_id, int) and name_or_id != bid:
            raise ValueError("buffer id %d: ids are dense in registration order (next: %d)"
                             % (name_or_id, bid))
        ptr, nbytes, dt, flags = _describe(tensor)
        _check(self._lib, self._lib.r2ccl_snap_register(
            self._h, bid, ptr, nbytes, dt, CODEC_LOSSY if lossy else CODEC_LOSSLESS, flags))
        self._refs.append(tensor)
        self.names.append(str(name_or_id))
        return bid

    def register_torch_module(self, model, optimizer=None, lossy=False):
        """Registers model.named_parameters() in order, then the optimizer's state tensors
        (param_groups order, each parameter's state keys sorted). The optimizer state must
        exist (call after one optimizer step, or initialise it). lossy applies to FP16/BF16
        tensors. Returns the names registered."""
        import torch
        names = []
        index = {}
        for name, p in model.named_parameters():
            index[id(p)] = name
            self.register("param:" + name, p.data, lossy=lossy and p.dtype in
                          (torch.float16, torch.bfloat16))
            names.append("param:" + name)
        if optimizer is not None:
            for gi, group in enumerate(optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    pname = index.get(id(p), "group%d.%d" % (gi, pi))
                    st = optimizer.state.get(p)
                    if not st:
                        if p.requires_grad:
                            raise ValueError(
                                "optimizer state of %s is empty: call register_torch_module "
                                "after one optimizer step, or initialise the state" % pname)
                        continue
                    for key in sorted(st.keys()):
                        v = st[key]
                        if v is None:
                            continue
                        if not torch.is_tensor(v):
                            raise ValueError("optimizer state %s[%r] is a %s, not a tensor "
                                             "(only tensors can be registered)"
                                             % (pname, key, type(v).__name__))
                        n = "opt:%s:%s" % (pname, key)
                        self.register(n, v, lossy=lossy and v.dtype in
                                      (torch.float16, torch.bfloat16))
                        names.append(n)
        return names

    # ---- metadata ----
    def set_loss_scale(self, value):
        _check(self._lib, self._lib.r2ccl_snap_set_loss_scale(self._h, float(value)))

    def get_loss_scale(self):
        v = ctypes.c_double()
        _check(self._lib, self._lib.r2ccl_snap_get_loss_scale(self._h, ctypes.byref(v)))
        return v.value

    def set_rng_state(self, blob):
        blob = bytes(blob)
        _check(self._lib, self._lib.r2ccl_snap_set_rng_state(self._h, blob, len(blob)))

    def get_rng_state(self):
        buf = ctypes.create_string_buffer(MAX_RNG_BYTES)
        n = ctypes.c_size_t()
        _check(self._lib, self._lib.r2ccl_snap_get_rng_state(
            self._h, ctypes.cast(buf, ctypes.c_void_p), MAX_RNG_BYTES, ctypes.byref(n)))
        return buf.raw[:n.value]

    def capture_torch_rng(self):
        """set_rng_state(torch.get_rng_state()) (the CPU generator)."""
        import torch
        self.set_rng_state(torch.get_rng_state().numpy().tobytes())

    def restore_torch_rng(self):
        """torch.set_rng_state() from the blob get_rng_state() returns (after restore)."""
        import numpy as np
        import torch
        blob = self.get_rng_state()
        torch.set_rng_state(torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy()))

    # ---- snapshots ----
    def take(self, step):
        """Snapshots `step` (or skips it: see R2CCL_SNAPSHOT_INTERVAL). Returns the stats as a
        dict: skipped, step, copy_seconds, wait_seconds and prev_* of the newest finished take
        (prev_valid, prev_step, prev_encode_seconds, prev_send_seconds, prev_raw_bytes,
        prev_encoded_bytes, prev_ratio, prev_max_abs_error, prev_base_buffers)."""
        st = _TakeStats()
        _check(self._lib, self._lib.r2ccl_snap_take(self._h, int(step), ctypes.byref(st)))
        return {f: getattr(st, f) for f, _ in _TakeStats._fields_}

    def flush(self, timeout_s=None):
        _check(self._lib, self._lib.r2ccl_snap_flush(self._h, _us(timeout_s)))

    def restore(self, timeout_s=None):
        """Restores the newest complete step into every registered buffer; returns the step.
        R2CCL_SNAPSHOT_RESTORE=direct (default) decodes into the buffers: an error raised after
        decoding began says they were partly or wholly overwritten (restore again); staged
        leaves them untouched on errors (snapshot_client.h, r2ccl_snap_restore())."""
        step = ctypes.c_uint64()
        _check(self._lib, self._lib.r2ccl_snap_restore(self._h, _us(timeout_s),
                                                       ctypes.byref(step)))
        return step.value

    # ---- state ----
    @staticmethod
    def _state_dict(s):
        members = [i for i in range(MAX_NODES) if (s.members[i // 64] >> (i % 64)) & 1]
        return {"epoch": s.epoch, "node_id": s.node_id, "n_nodes": s.n_nodes,
                "member_count": s.member_count, "members": members,
                "complete_step": s.complete_step if s.has_complete_step else None,
                "changes": s.changes, "states_received": s.states_received}

    def state(self):
        """The daemon's latest STATE: epoch, node_id, n_nodes, member_count, members (list of
        node ids), complete_step (None: nothing restorable), changes, states_received."""
        s = _State()
        _check(self._lib, self._lib.r2ccl_snap_state(self._h, ctypes.byref(s)))
        return self._state_dict(s)

    def wait_event(self, timeout_s=None):
        """Waits for a change of epoch or complete step; returns the state dict ('changes':
        CHANGED_EPOCH | CHANGED_COMPLETE) or None on timeout."""
        s = _State()
        rc = self._lib.r2ccl_snap_wait_event(self._h, _us(timeout_s), ctypes.byref(s))
        if rc == ERR_TIMEOUT:
            return None
        _check(self._lib, rc)
        return self._state_dict(s)

    # ---- kv ----
    def kv_put(self, key, value):
        v = value.encode() if isinstance(value, str) else bytes(value)
        _check(self._lib, self._lib.r2ccl_snap_kv_put(self._h, key.encode(), v, len(v)))

    def kv_get(self, key, timeout_s=None):
        """The value (bytes); raises SnapshotTimeout when not published within timeout_s."""
        buf = ctypes.create_string_buffer(MAX_KV_VALUE)
        n = ctypes.c_size_t()
        _check(self._lib, self._lib.r2ccl_snap_kv_get(
            self._h, key.encode(), ctypes.cast(buf, ctypes.c_void_p), MAX_KV_VALUE,
            ctypes.byref(n), _us(timeout_s)))
        return buf.raw[:n.value]

    # ---- lifetime ----
    def close(self, flush_timeout_s=10.0):
        """Flushes (up to flush_timeout_s; None: no flush) and closes. Idempotent."""
        if self._h is None:
            return
        try:
            if flush_timeout_s is not None:
                try:
                    self.flush(flush_timeout_s)
                except SnapshotError:
                    pass  # closing anyway; the error was the daemon's or a timeout
        finally:
            self._lib.r2ccl_snap_close(self._h)
            self._h = None
            self._refs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def recovery_hint():
        """See the module function recovery_hint()."""
        return recovery_hint()

    @staticmethod
    def log_recovered(lost_nodes, phases):
        """See the module function log_recovered()."""
        return log_recovered(lost_nodes, phases)

    def __del__(self):
        if getattr(self, "_h", None) is not None:
            self._lib.r2ccl_snap_close(self._h)
            self._h = None


def recovery_hint():
    """The post-recovery hint (factor, steps): multiply the learning rate by `factor` for the
    first `steps` steps after a recovery (R2CCL_RECOVERY_LR_FACTOR in (0, 1], default 0.8;
    R2CCL_RECOVERY_LR_STEPS 0..1000, default 3). An invalid variable raises SnapshotError
    naming it and the accepted form."""
    lib = load_library()
    factor, steps = ctypes.c_double(), ctypes.c_int()
    _check(lib, lib.r2ccl_snap_recovery_hint(ctypes.byref(factor), ctypes.byref(steps)))
    return factor.value, steps.value


def log_recovered(lost_nodes, phases):
    """Logs and returns "[R2CCL] Successfully recovered in X s (node loss: NODES; P S s, ...)":
    lost_nodes a list of node ids (or names), phases a list of (name, seconds); X is their sum.
    The line on stderr is stamped like every r2ccl event line: "[SEC.USEC] [R2CCL] ..."."""
    lib = load_library()
    nodes = ",".join(str(n) for n in lost_nodes).encode()
    names = (ctypes.c_char_p * max(1, len(phases)))(*[str(n).encode() for n, _ in phases])
    secs = (ctypes.c_double * max(1, len(phases)))(*[float(t) for _, t in phases])
    buf = ctypes.create_string_buffer(4096)
    _check(lib, lib.r2ccl_snap_log_recovered(nodes, len(phases), names, secs, buf, len(buf)))
    return buf.value.decode()


def remap_rank(old_rank, surviving_old_ranks):
    """The rank after a shrink: survivors keep their order, renumbered 0..n-1 (so the lowest
    surviving rank becomes 0). Returns (new_rank, new_world)."""
    s = sorted(surviving_old_ranks)
    return s.index(old_rank), len(s)


def _free_port():
    with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_host():
    env = os.environ.get("R2CCL_PG_HOST")
    if env:
        return env
    try:
        return _socket.gethostbyname(_socket.gethostname())
    except OSError:
        return "127.0.0.1"


def reinit_process_group(snap, epoch, rank, world, backend="gloo", host=None, timeout_s=300.0,
                         **init_kwargs):
    """Replaces torch.distributed's default group after a membership change (epoch: the agreed
    epoch from snap.state()/wait_event(); rank, world: this process's place in the NEW group).

    Rank and world: with replacement processes (a new process opens with the lost rank's id)
    both stay as they were; after a shrink use remap_rank(old_rank, survivors), which keeps the
    survivors' order, so the lowest surviving rank becomes rank 0. New rank 0 picks a free TCP
    port on this host (R2CCL_PG_HOST, else the hostname's address) and publishes
    "pg-<epoch>" = "host:port" through the daemons' kv; the others kv_get it (up to timeout_s),
    then every rank calls init_process_group(backend, "tcp://host:port", rank, world).
    (The port is free when picked; another process could take it before rank 0 binds it.)
    Returns the "host:port" used."""
    import datetime
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    key = "pg-%d" % epoch
    if rank == 0:
        addr = "%s:%d" % (host or _my_host(), _free_port())
        snap.kv_put(key, addr)
    else:
        addr = snap.kv_get(key, timeout_s).decode()
    h, port = addr.rsplit(":", 1)
    dist.init_process_group(backend, init_method="tcp://%s:%s" % (h, port), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            **init_kwargs)
    return addr
