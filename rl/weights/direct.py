"""The direct weight path (`policy.weight_sync: direct`): learner rank 0 sends each version to
every generator over torch.distributed, a process group of its own (NCCL on GPUs, gloo on
CPU), beside the learner's training group and unknown to it.

    sender = DirectSender(run_dir, backend="gloo")       # learner rank 0
    sender.send(12, state)                               # returns at once; a thread sends
    feed = sender.stream(13, layout); feed.put(bucket); ...; feed.close()   # sent as gathered
    recv = DirectReceiver(run_dir, "gen-0", device=cpu)  # a generator
    recv.take()                                          # (12, state) once received, else None

Rendezvous: rank 0 serves a store of the run (hpcrl.rl.common.distenv: CURVE, the run's keys,
this node's address) named in `weights/direct.json`; a generator (whenever it starts, also
after a restart) joins by number and both build a two-member group (`pair/<n>`), on a thread
of the sender's, so a join that never completes holds up no delivery. Pairs, not one group, so
generators come and go without anyone rebuilding; a pair whose generator is gone fails on the
next send and is dropped. Only holders of the run's keys can join or drop one (`leave/<n>`).

Per version: a control message (fixed size, JSON) with the layout, every bucket's tensors
(rl/weights/shards.py's `Bucket`, the flat buffer a chunk of parameters is gathered into; the
layout is known before gathering); each bucket's bytes in one broadcast as soon as gathered;
then whether the version is complete. Knowing the layout, a receiver posts every bucket's
receive at once, so the bytes flow back to back.

The swap copies nothing: a receiver has two sets of flat buffers and lands each version in the
one the model does not use; the swap makes the model's parameters views of it
(`copy_state(..., share=True)`) and the set used until then takes the next version. The model
never reads a version being received, and memory stays at twice the weights. On GPUs the sets
are on the generator's device (NCCL fills them, nothing passes through the host) and CUDA events
order the two threads' streams: the swap waits for the receive, a receive into a set for the
generator's work queued before it let go of that set. Files are still written (restarts and
late joiners read them); a generator takes whichever is newer.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from hpcrl.core.files import atomic_write_json
from hpcrl.rl.common.distenv import RunStore, StoreServer, node_address
from hpcrl.rl.model.policy import copy_state
from hpcrl.rl.weights.shards import Bucket

__all__ = ["DirectSender", "DirectReceiver", "DirectWeights", "Feed", "pair_group"]

log = logging.getLogger("hpcrl.weights")
SERVICE = "weights-direct"  # the sender's store: endpoints/weights-direct.json
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}
_BUCKET_NUMEL = 1 << 26  # what `send` packs a plain state into per bucket (a learner's gather chunks are its own)
_CTRL_BYTES = 1 << 14  # a control message: 8 bytes of length, the JSON (a longer one follows on its own)
_END, _ABORT = object(), object()


def pair_group(backend: str, store, rank: int, timeout_s: float):
    """A two-member process group on `store`, outside torch.distributed's default group."""
    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _shutdown(pg) -> None:
    """Abort `pg` (unblocking a thread waiting in it) and release its resources."""
    for how in ("abort", "shutdown"):
        try:
            getattr(pg, how)()
            return
        except Exception:
            continue


def _bcast_async(pg, t: torch.Tensor):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def _ctrl(head: dict, device) -> list[torch.Tensor]:
    """`head` as the fixed-size control message, plus the JSON on its own if it does not fit."""
    raw = json.dumps(head, separators=(",", ":")).encode()
    ctrl = torch.zeros(_CTRL_BYTES, dtype=torch.uint8)
    ctrl[:8] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
    body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if len(raw) <= _CTRL_BYTES - 8:
        ctrl[8 : 8 + len(raw)] = body
        return [ctrl.to(device)]
    return [ctrl.to(device), body.to(device)]


def _read_ctrl(pg, ctrl: torch.Tensor) -> dict:
    """The JSON of a received control message (receiving its continuation, if any)."""
    host = ctrl.cpu()
    n = int(host[:8].view(torch.int64).item())
    if n <= _CTRL_BYTES - 8:
        return json.loads(host[8 : 8 + n].numpy().tobytes())
    body = torch.empty(n, dtype=torch.uint8, device=ctrl.device)
    _bcast_async(pg, body).wait()
    return json.loads(body.cpu().numpy().tobytes())


class DirectSender:
    def __init__(self, run_dir: str | Path, backend: str, device=None, timeout_s: float = 600.0, host=None):
        self.backend, self.timeout_s = backend, timeout_s
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        # `host`: the address generators know this node by (None: its name); 127.0.0.1 keeps it on the node.
        self.server = StoreServer(run_dir, SERVICE, name="learner-direct", bind_host=node_address(host))
        self.store = RunStore(run_dir, SERVICE, "learner-direct", datetime.timedelta(seconds=timeout_s))
        self.info = {"service": SERVICE, "backend": backend, "instance": self.server.endpoint.instance}
        (Path(run_dir) / "weights").mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(run_dir) / "weights" / "direct.json", self.info)
        self.members: dict[int, object] = {}
        self._members_lock = threading.Lock()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (number, pair) built, not yet members
        self._joined = 0
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hpcrl-direct-send", daemon=True)
        self._thread.start()
        self._joiner = threading.Thread(target=self._accept_loop, name="hpcrl-direct-join", daemon=True)
        self._joiner.start()
        self.sent_s = 0.0

    def _accept_loop(self) -> None:
        """Generators join whenever they come, each pair built in a thread of its own: the sends
        go on meanwhile, and a join that never completes costs its thread, not a delivery."""
        while not self._closed:
            try:
                n = self.store.add("joins", 0)
            except Exception as exc:
                if self._closed:
                    return
                log.warning("direct weights: cannot read the joins: %s", exc)
                n = self._joined
            while self._joined < n:
                self._joined += 1
                threading.Thread(target=self._join, args=(self._joined,), name="hpcrl-direct-pair", daemon=True).start()
            time.sleep(0.2)

    def _join(self, n: int) -> None:
        try:
            pg = pair_group(self.backend, torch.distributed.PrefixStore(f"pair/{n}", self.store), 0, self.timeout_s)
        except Exception as exc:  # the generator went away while joining
            log.warning("direct weights: generator %d could not join: %s", n, exc)
            return
        self._ready.put((n, pg))  # the sending thread admits it between versions (_admit)

    def _admit(self) -> None:
        """Make the pairs built meanwhile members, each told so (a welcome) from this
        thread, so a receiver counts itself connected only once the next version will reach it."""
        while True:
            try:
                n, pg = self._ready.get_nowait()
            except queue.Empty:
                return
            if not self._to_all({n: pg}, {"welcome": True}):  # it left while joining
                _shutdown(pg)
                continue
            with self._members_lock:
                self.members[n] = pg

    def _reap(self) -> None:
        """Let go of the members that asked to leave (DirectReceiver.close): a goodbye frees the
        receiver's thread from the broadcast it waits in, which nothing on its side can abort."""
        with self._members_lock:
            members = list(self.members)
        for n in [n for n in members if self.store.check([f"leave/{n}"])]:
            with self._members_lock:
                pg = self.members.pop(n, None)
            if pg is None:
                continue
            self._to_all({n: pg}, {"bye": True})
            _shutdown(pg)

    def send(self, version: int, state: Mapping[str, torch.Tensor] | Sequence[Bucket]) -> None:
        """Queue `state` for every member (waits while the previous version is still going out):
        buckets as they are, a plain mapping packed into buckets (a copy) first."""
        buckets = list(state) if not isinstance(state, Mapping) else Bucket.pack(state, _BUCKET_NUMEL)
        feed = self.stream(version, [b.specs for b in buckets])
        for bucket in buckets:
            feed.put(bucket)
        feed.close()

    def stream(self, version: int, layout: Sequence[Sequence[tuple[str, torch.dtype, Sequence[int]]]]) -> Feed:
        """A version whose buckets come one by one (`Feed.put`, as the learner gathers them), their
        tensors (name, dtype, shape) as `layout` says; each goes out as soon as it is put (after
        the version before). A bucket other than announced drops the version. Waits while a
        version is queued."""
        feed = Feed([[(n, d, tuple(int(x) for x in shape)) for n, d, shape in specs] for specs in layout])
        self._q.put((version, feed))
        return feed

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        """Send what is queued, tell every member goodbye, and tear the pairs down.

        Groups left to interpreter teardown join their gloo threads in arbitrary order, which
        aborts the process at exit ("terminate called without an active exception")."""
        if self._closed:
            return
        self._q.put(None)
        self._thread.join()
        with self._members_lock:
            self._closed = True
            for pg in self.members.values():
                _shutdown(pg)
            self.members.clear()
        self._joiner.join(5)
        while not self._ready.empty():  # built after the last send: never members
            _shutdown(self._ready.get()[1])
        self.store.close()
        self.server.close()

    def _loop(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=0.2)
            except queue.Empty:
                self._admit()
                self._reap()
                continue
            if item is None:  # close(): a goodbye lets each receiver leave its pair cleanly
                with self._members_lock:
                    members = dict(self.members)
                self._to_all(members, {"bye": True})
                self._q.task_done()
                return
            version, feed = item
            try:
                t0 = time.perf_counter()
                self._admit()
                self._send_version(version, feed)
                self.sent_s = time.perf_counter() - t0
            finally:
                self._q.task_done()

    def _send_version(self, version: int, feed: Feed) -> None:
        """The layout, each bucket as it arrives, then whether the version is complete. Receivers
        expect every announced bucket: after an abort or a bucket other than announced, the rest
        go out as zeros and the end says the version is dropped."""
        with self._members_lock:
            members = dict(self.members)
        works: dict[int, list] = {n: [] for n in members}  # each member's broadcasts in flight
        head = {"version": version, "buckets": [[[n, str(d), list(s)] for n, d, s in specs] for specs in feed.layout]}
        self._post(members, works, _ctrl(head, self.device))
        complete, filler = True, None
        for k, specs in enumerate(feed.layout):
            bucket = feed.get() if complete else None
            if complete and (not isinstance(bucket, Bucket) or bucket.specs != specs):
                if bucket is not _ABORT:
                    log.warning("direct weights: v%d bucket %d is not the one announced; version dropped", version, k)
                complete = False
            nbytes = Bucket.bytes_for(specs)
            if not nbytes:
                continue
            if not complete and filler is None:  # zeros for the rest
                most = max(Bucket.bytes_for(s) for s in feed.layout[k:])
                filler = torch.zeros(most, dtype=torch.uint8, device=self.device)
            self._post(members, works, [bucket.buffer.to(self.device) if complete else filler[:nbytes]])
        if complete and feed.get() is not _END:  # aborted after the last bucket, or more than announced
            complete = False
        self._post(members, works, _ctrl({"version": version, "end": complete}, self.device), limit=0)

    def _to_all(self, members: dict, head: dict) -> dict:
        """One control message to every member (a welcome, a goodbye); the members it reached."""
        self._post(members, {n: [] for n in members}, _ctrl(head, self.device), limit=0)
        return members

    def _post(self, members: dict, works: dict[int, list], msgs: list[torch.Tensor], limit: int = 3) -> None:
        """Start `msgs` to every member at once, then wait until at most `limit` of a member's
        broadcasts are in flight (on GPUs each holds a device copy of a bucket). A member that
        fails is dropped (here and for good)."""
        for n, pg in list(members.items()):
            try:
                works[n].extend(_bcast_async(pg, t) for t in msgs)
                while len(works[n]) > limit:
                    works[n].pop(0).wait()
                    if self.device.type == "cuda":  # there wait() only orders streams: hold this thread too
                        torch.cuda.current_stream(self.device).synchronize()
            except Exception as exc:
                log.warning("direct weights: generator %d dropped (%s)", n, exc)
                members.pop(n)
                with self._members_lock:
                    self.members.pop(n, None)


class Feed:
    """The buckets of one version on their way to the sending thread, in order."""

    def __init__(self, layout: list[list[tuple[str, torch.dtype, tuple[int, ...]]]]):
        self.layout = layout
        self._q: queue.Queue = queue.Queue()

    def put(self, bucket: Bucket) -> None:
        self._q.put(bucket)

    def close(self) -> None:
        """Every bucket is put: receivers may swap the version in."""
        self._q.put(_END)

    def abort(self) -> None:
        """The version will not be complete (the gather failed): receivers drop what they got."""
        self._q.put(_ABORT)

    def get(self):
        return self._q.get()


class DirectReceiver:
    """A generator's side: a thread joins the learner's store and receives every version, into
    whichever of its two buffer sets the model does not use."""

    def __init__(self, run_dir: str | Path, name: str, device=None, timeout_s: float = 600.0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "weights" / "direct.json"
        self.name, self.timeout_s = name, timeout_s
        self.device = device
        # (version, tensors, CUDA event of their arrival or None); tensors are views of _sets[_target]
        self._staged: tuple[int, dict[str, torch.Tensor], object] | None = None
        self._sets: list[list[torch.Tensor]] = [[], []]  # two sets of flat buffers, one per bucket
        self._live: int | None = None  # the set the model's parameters are views of
        self._target = 0  # the set being received into (never _live)
        self._let_go = None  # CUDA event: the generator's work queued before its last release()
        self._dev = torch.device("cpu")  # where the sets are (the current pair's)
        self._stop = threading.Event()
        self._link = None  # (store, member number) of the current pair, for close()
        self._link_lock = threading.Lock()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpcrl-direct-recv", daemon=True)
        self._thread.start()

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The version received last, if any; its tensors stay valid until `release()` (if bound,
        until the next bound release). On a GPU the caller's stream waits for their arrival."""
        staged = self._staged
        if staged is None:
            return None
        if staged[2] is not None:
            torch.cuda.current_stream(self._dev).wait_event(staged[2])
        return staged[0], staged[1]

    def release(self, bound: bool = False) -> None:
        """Done with the taken version. `bound`: the model's parameters are views of its tensors
        now, so the next version goes to the other set; else the next one reuses this set."""
        staged = self._staged
        if staged is None:
            return
        if staged[2] is not None:  # what the caller queued on its stream reading either set
            self._let_go = _mark(self._dev)
        if bound:
            self._live = self._target
        self._staged = None  # last: the receiving thread reads _live and _let_go once it sees this

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the pair and stop the thread, before interpreter teardown (see DirectSender.close).

        A gloo broadcast cannot be aborted from the waiting side, so the receiver asks the sender
        (a key in its store) for a goodbye; a sender that is gone fails the broadcast instead."""
        self._stop.set()
        with self._link_lock:  # the receiving thread closes the store only once this is done with it
            link = self._link
            if link is not None:
                try:
                    link[0].set(f"leave/{link[1]}", "1")
                except Exception:
                    pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("direct weights: the receiver did not leave its pair within %.0f s", timeout_s)

    def _loop(self) -> None:
        seen = None
        while not self._stop.is_set():
            try:
                info = json.loads(self.path.read_text())
            except (OSError, ValueError):
                time.sleep(0.5)
                continue
            if info["instance"] == seen:
                time.sleep(0.5)  # the learner we had is gone and no new one announced itself yet
                continue
            seen = info["instance"]
            try:
                self._serve(info)
            except Exception as exc:  # the learner restarted or the link broke: join again
                if self._stop.is_set():  # close() aborted the pair
                    return
                log.warning("direct weights: link to the learner lost (%s); rejoining", exc)
                self.connected.clear()
                seen = None if self._stop.is_set() else seen
                time.sleep(0.5)

    def _serve(self, info: dict) -> None:
        # As this generator, with the run's keys: the sender's store admits nobody else.
        store = RunStore(self.run_dir, info["service"], self.name, datetime.timedelta(seconds=60))
        try:
            n = store.add("joins", 1)
            pg = pair_group(info["backend"], torch.distributed.PrefixStore(f"pair/{n}", store), 1, self.timeout_s)
        except BaseException:
            store.close()
            raise
        self._link = (store, n)
        try:
            if self._stop.is_set():  # close() came while joining: leave at once
                store.set(f"leave/{n}", "1")
            else:
                self._receive(pg, info)
        finally:
            with self._link_lock:
                self._link = None
            self.connected.clear()
            _shutdown(pg)
            store.close()

    def _receive(self, pg, info: dict) -> None:
        dev = self._dev = torch.device(self.device or ("cuda" if info["backend"] == "nccl" else "cpu"))
        ctrl = torch.empty(_CTRL_BYTES, dtype=torch.uint8, device=dev)
        pending = _bcast_async(pg, ctrl)  # the next control message's receive, always posted
        while not self._stop.is_set():
            pending.wait()
            head = _read_ctrl(pg, ctrl)
            if "bye" in head:  # the learner said goodbye: wait for the next one to announce itself
                return
            if "welcome" in head:  # the sender counts us among its members from now on
                self.connected.set()
                pending = _bcast_async(pg, ctrl)
                continue
            # A version: its layout, each bucket's bytes, then whether it is complete.
            layout = [[(n, _DTYPES[d], s) for n, d, s in specs] for specs in head["buckets"]]
            while self._staged is not None:  # a set is free only once the last version was swapped in
                if self._stop.wait(0.001):
                    return
            self._target = 1 if self._live == 0 else 0
            if self._let_go is not None and dev.type == "cuda":  # the model's reads, queued before it let go
                torch.cuda.current_stream(dev).wait_event(self._let_go)
            buffers = self._sets[self._target]
            del buffers[len(layout) :]
            works = []
            for k, specs in enumerate(layout):
                nbytes = Bucket.bytes_for(specs)
                if k == len(buffers) or buffers[k].numel() != nbytes or buffers[k].device != dev:
                    buffers[k : k + 1] = [torch.empty(nbytes, dtype=torch.uint8, device=dev)]  # else reused
                if nbytes:
                    works.append(_bcast_async(pg, buffers[k]))
            pending = _bcast_async(pg, ctrl)
            for w in works:
                w.wait()
            pending.wait()
            end = _read_ctrl(pg, ctrl)
            pending = _bcast_async(pg, ctrl)
            if end.get("end") and layout:  # complete (an aborted version is dropped)
                state = {n: t for specs, b in zip(layout, buffers) for n, t in Bucket(specs, buffer=b).tensors.items()}
                self._staged = (int(end["version"]), state, _mark(dev))


def _mark(device: torch.device):
    """A CUDA event after the work queued so far on this thread's stream (None off GPUs)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class DirectWeights:
    """`load_if_newer` for a generator: the newest of what came directly and what the files hold."""

    def __init__(self, files, receiver: DirectReceiver):
        self.files, self.receiver = files, receiver
        self.last_swap_s = 0.0

    def load_if_newer(self, model, have: int) -> int | None:
        got = self.receiver.take()
        if got is not None:
            bound = False
            try:
                if got[0] > have:
                    t0, bound = time.perf_counter(), True  # the model's parameters: views of the set
                    copy_state(model, got[1], f"weights v{got[0]} (direct)", share=True)
                    self.last_swap_s = time.perf_counter() - t0
                    return got[0]
            except ValueError:  # a mismatch, refused before anything was bound
                bound = False
                raise
            finally:
                self.receiver.release(bound)
        return self.files.load_if_newer(model, have)
