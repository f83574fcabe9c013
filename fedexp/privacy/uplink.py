"""Client-level DP on the uplink: where clipping and noise act in a round, and what ε it costs.

The order is fixed (docs/privacy.md):

1. client: its upload, all parts together, clipped to L2 norm C (a "model" part: its change
   from the model the client received this round), or with ``privacy.part_clip`` each part p
   to C·√s_p, jointly still within C (:mod:`fedexp.privacy.clipping`); with ``mode=local``
   the client adds N(0, z²C²) to each coordinate;
2. the codec compresses what 1 produced, and the wire carries it;
3. server (``mode=central``): what it decoded is clipped again, as in 1, when the uplink is
   lossy (error feedback can send more than C), then noised. If the algorithm's server reads
   the uploads only through their weighted mean (``Algorithm.server_reads == "mean"``), one draw of
   N(0, z²C²) is added to their sum, divided by the expected cohort size E (DP-FedAvg,
   McMahan et al. 2018), also when a Poisson cohort is empty (:meth:`PrivateUplink.empty_release`);
   otherwise every upload gets its own draw, and the run is accounted as local DP.

Settings whose noise would drown every update are refused before round 0
(:data:`DROWNING`).

Every DP run weighs the clients uniformly (sample counts would reveal a client's data size).
Parts of kind "exact" (IFCA's cluster id) are neither clipped nor noised, and not covered.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedexp import streams
from fedexp.contract import Message
from fedexp.contract import Stacked
from fedexp.contract import parts_updates
from fedexp.contract import update_parts
from fedexp.privacy.clipping import clipping_of
from fedexp.privacy.mechanisms import adaptive_clip
from fedexp.privacy.mechanisms import add_gaussian_rows
from fedexp.privacy.mechanisms import gaussian
from fedexp.privacy.mechanisms import update_noise_multiplier
from fedexp.privacy.settings import Privacy

if TYPE_CHECKING:  # dp-accounting (and SciPy) load when a run has privacy on: ~1 s
    from fedexp.privacy import accountant

_COUNT = 1 << 62  # the server stream's "client" slot of the adaptive clip count's noise

DROWNING = 100.0
"""Refused: noise whose std on each coordinate of what the server aggregates exceeds this
many times C, the bound of a whole clipped update's norm (every coordinate together).

The std on the aggregate is zC/E for one draw on the sum (z of the update sum with adaptive
clipping), zC/√E for a draw on each upload averaged over E uploads (E: the expected cohort,
at least 1). Past it, one round's noise on a single coordinate is 100 times anything the
clients can send, and a run ends in a "diverged" loss that a smaller lr cannot cure (e.g.
``privacy=local privacy.target_epsilon=1e-9``: about 10⁵). The documented runs of
docs/results.md stay below 20 (pFedNet at ε = 1, z = 81 on each of E = 20 uploads: 18).
"""


def _parts(stacked: Stacked) -> dict[str, torch.Tensor]:
    return {"": stacked} if isinstance(stacked, torch.Tensor) else dict(stacked)


def _like(stacked: Stacked, parts: dict[str, torch.Tensor]) -> Stacked:
    return parts[""] if isinstance(stacked, torch.Tensor) else parts


def _tag(name: str) -> tuple[int, ...]:
    return (zlib.crc32(name.encode()),) if name else ()


def _noise_keys(
    seed: int, purpose: int, round_: int, clients: list[int], name: str
) -> torch.Tensor:
    """[m] keys of the clients' noise streams of part ``name`` in ``round_`` (one a client).

    The (seed, ``purpose``, round, client) stream keys (:func:`fedexp.streams.stream_keys`),
    mixed with the part's CRC-32 for a named part: each client's noise is a function of these
    alone, whichever clients share its cohort (:func:`.mechanisms.add_gaussian_rows`).
    """
    keys = streams.stream_keys(seed, purpose, round_, clients)
    return streams.mix64(keys ^ zlib.crc32(name.encode())) if name else keys


class PrivateUplink:
    """A run's DP mechanism on the uplink, its clip bound and its privacy spent.

    Args:
        settings: the ``privacy`` group.
        server_reads: the algorithm's :attr:`~fedexp.algorithms.base.Algorithm.server_reads`.
        kinds: the algorithm's uplink part kinds (unlisted: "update").
        num_clients: N.
        participation: q.
        rounds: the planned rounds (for ``target_epsilon``).
        seed: the run's seed (the noise streams' root).
        sketch: the algorithm sends a summary of each client's data before round 0
            (pFedNet's similarity sketch), which this mechanism does not cover.
        algorithm: the algorithm's name, for the messages of a ``part_clip`` that does not
            name its upload parts.

    Raises:
        ValueError: settings the algorithm or the run cannot meet, in one line.
    """

    def __init__(
        self,
        settings: Privacy,
        server_reads: str,
        kinds: Mapping[str, str],
        num_clients: int,
        participation: float,
        rounds: int,
        seed: int,
        sketch: bool = False,
        algorithm: str | None = None,
    ) -> None:
        self.settings, self.kinds, self.seed = settings, kinds, seed
        #: all parts together to C, or each to its share (``privacy.part_clip``)
        self.clipping = clipping_of(settings.part_clip, kinds, algorithm)
        self.num_clients, self.rate, self.rounds = num_clients, participation, rounds
        self.summed = settings.mode == "central" and server_reads == "mean"
        if settings.adaptive and not self.summed:
            raise ValueError(
                "privacy.adaptive=true: adaptive clipping needs an algorithm whose server reads "
                "only the uploads' mean (this one reads each upload)"
            )
        fixed = settings.sampling == "fixed"
        self.expected = (
            max(1, round(participation * num_clients)) if fixed else (participation * num_clients)
        )
        # replace-one adjacency (a fixed cohort; a server or a party that sees single uploads):
        # one client moves what is noised by up to 2C, so the accountant gets z/2 (noise per
        # unit of sensitivity)
        self.sensitivity = 2.0 if (fixed or not self.summed) else 1.0
        z = settings.noise_multiplier
        if settings.target_epsilon is not None:
            plan = self.plan(1.0)
            from fedexp.privacy import accountant

            z = accountant.calibrate_noise(plan, rounds, settings.target_epsilon)
            z *= self.sensitivity
        self.noise_multiplier = z
        # the paper's E/20, raised to z where that is less (the count then takes at most a
        # quarter of the budget: z_Δ ≤ 1.16 z), so that the default always composes
        self.count_stddev = settings.count_stddev or max(self.expected / 20, z)
        self.update_multiplier = (
            update_noise_multiplier(z, self.count_stddev) if settings.adaptive else z
        )
        self.clip = settings.clip
        self._refuse_drowning(rounds)
        self.participations = torch.zeros(num_clients, dtype=torch.int64)
        #: rounds that released something (a round whose cohort was empty counts too)
        self.released = 0
        self._uploads_nothing = False
        self.unprotected = [f"part {name!r}" for name, k in sorted(kinds.items()) if k == "exact"]
        if sketch:
            self.unprotected.append("the set-up sketch")

    def aggregate_noise(self) -> float:
        """The noise's std on each coordinate of what the server aggregates, over C.

        z_Δ/E with one draw on the sum; z/√E with a draw on each of E uploads (E >= 1).
        """
        if self.summed:
            return self.update_multiplier / self.expected
        return self.noise_multiplier / max(1.0, self.expected) ** 0.5

    def _refuse_drowning(self, rounds: int) -> None:
        """Refuse noise past :data:`DROWNING` times C, naming the setting that asked for it."""
        ratio = self.aggregate_noise()
        if not ratio > DROWNING:
            return
        s = self.settings
        if s.target_epsilon is not None:
            key = f"privacy.target_epsilon={s.target_epsilon:g}"
            why = f"calibrated to it over rounds={rounds} at privacy.delta={s.delta:g}"
            fix = "raise privacy.target_epsilon"
        else:
            key, why = f"privacy.noise_multiplier={s.noise_multiplier:g}", "as set"
            fix = "lower privacy.noise_multiplier"
        where = "the noised sum / E" if self.summed else "the mean of the noised uploads"
        raise ValueError(
            f"{key}: the noise drowns every update: its std on each coordinate of {where} is "
            f"{ratio * s.clip:.3g} = {ratio:.3g} × privacy.clip={s.clip:g} "
            f"(z={self.noise_multiplier:.4g}, {why}; E={self.expected:g} expected uploads a "
            f"round), more than {DROWNING:g} "
            f"times the norm bound C of a whole update; {fix} (or the cohort, participation × "
            "num_clients)"
        )

    # ------------------------------------------------------------------ accounting
    def plan(self, z: float | None = None) -> accountant.PrivacyPlan:
        """The accountant's view of one round.

        ``z``: noise per unit of sensitivity (default: the run's σ/C over ``sensitivity``).

        A server that reads each upload is accounted as local DP: its outputs may depend on
        every single upload, so neither the sum's sensitivity nor sampling's amplification
        can be counted on.
        """
        if z is None:
            z = self.noise_multiplier / self.sensitivity
        from fedexp.privacy import accountant

        mode = "central" if self.summed else "local"
        return accountant.PrivacyPlan(
            mode=mode,
            sampling=self.settings.sampling,
            num_clients=self.num_clients,
            rate=self.rate,
            noise_multiplier=z,
            delta=self.settings.delta,
            accountant=accountant.resolve_accountant(
                self.settings.accountant, mode, self.settings.sampling
            ),
        )

    def epsilon(self, rounds: int) -> float:
        """ε at the run's δ after ``rounds`` rounds, as reported each round.

        With PLD, before the planned last round: the ε of the next point of the schedule,
        an upper bound within 3 % of rounds (:func:`fedexp.privacy.accountant.epsilon`).
        """
        most = int(self.participations.max()) if self.num_clients else 0
        from fedexp.privacy import accountant

        return accountant.epsilon(
            self.plan(), rounds, None if self.summed else most, planned=self.rounds
        )

    def sample(self, round_: int) -> list[int]:
        """The round's cohort: Poisson (``sampling=poisson``) or fixed-size."""
        if self.settings.sampling == "poisson":
            return streams.poisson_sample(self.seed, round_, self.num_clients, self.rate)
        return streams.sample_clients(self.seed, round_, self.num_clients, self.rate)

    # ------------------------------------------------------------------ the two ends
    def _changes(
        self, parts: dict[str, torch.Tensor], refs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Each protected part ``[m, d]``: an update as it is, a model less its reference."""
        out = {}
        for name, stack in parts.items():
            kind = self.kinds.get(name, "update")
            if kind == "exact":
                continue
            flat = stack.reshape(stack.shape[0], -1)
            out[name] = flat - refs[name] if kind == "model" else flat
        return out

    def _rebuild(
        self,
        parts: dict[str, torch.Tensor],
        changes: dict[str, torch.Tensor],
        refs: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        out = dict(parts)
        for name, v in changes.items():
            value = refs[name] + v if self.kinds.get(name, "update") == "model" else v
            out[name] = value.reshape(parts[name].shape).to(parts[name].dtype)
        return out

    def references(
        self, parts: dict[str, torch.Tensor], inbox: Stacked | None, x0: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The reference ``[m, d]`` of each "model" part: what the client received this round.

        The received part of the same name, else the received message, else the common
        initial model, else zeros (the first of these of the part's size).
        """
        refs = {}
        for name, stack in parts.items():
            if self.kinds.get(name, "update") != "model":
                continue
            m, d = stack.shape[0], stack[0].numel()
            found = None
            candidates = [inbox.get(name)] if isinstance(inbox, dict) else [inbox]
            for c in candidates:
                if isinstance(c, torch.Tensor) and c.shape[0] == m and c[0].numel() == d:
                    found = c.reshape(m, d).to(stack.dtype)
            if found is None:
                found = (x0 if x0.numel() == d else torch.zeros(d)).to(stack).expand(m, d)
            refs[name] = found
        return refs

    def client_side(
        self, round_: int, clients: list[int], uploads: Stacked, refs: dict[str, torch.Tensor]
    ) -> tuple[Stacked, dict[str, float]]:
        """Step 1: every upload clipped (and, for local DP, noised) before the codec.

        Returns the uploads and their counts: how many, and how many were left whole (the
        clients' bits of adaptive clipping; with ``part_clip``, also how many of each part),
        summed over the ranks by the engine and passed to :meth:`end_round`.
        """
        parts = _parts(uploads)
        changes = self._changes(parts, refs)
        if not changes:
            return uploads, {}
        clip = self.clipping.clip(changes, self.clip)
        # whether any upload is clipped, and how many are within C: one read of all
        any_clipped, unclipped, *each = clip.flags.to(torch.float64).tolist()
        clipped = bool(any_clipped)
        counts = {"privacy/uploads": float(len(clients)), "privacy/unclipped": unclipped}
        counts.update(zip(clip.keys, each, strict=True))
        noisy = self.settings.mode == "local" and self.noise_multiplier > 0
        if not (clipped or noisy):
            return uploads, counts
        std = self.noise_multiplier * self.clip
        for name, v in changes.items():
            v = v * clip.factors[name].to(v)[:, None] if clipped else v.clone()
            if noisy:  # all the cohort's rows at once, each row from its client's stream
                keys = _noise_keys(self.seed, streams.PRIVACY_CLIENT, round_, clients, name)
                add_gaussian_rows(v, keys, std)
            changes[name] = v
        out = self._rebuild(parts, changes, refs)
        return _like(uploads, out), counts

    def server_side(
        self,
        round_: int,
        clients: list[int],
        updates: Mapping[int, Message],
        refs: dict[str, torch.Tensor],
        lossy: bool,
    ) -> tuple[Mapping[int, Message], dict[int, float], dict[str, float]]:
        """Step 3: the decoded uploads re-clipped and noised (central DP); uniform weights."""
        m = len(clients)
        weights = {n: 1.0 / m for n in clients}
        metrics = {"privacy/clip": self.clip}
        if self.settings.mode != "central" or m == 0:
            return updates, weights, metrics
        parts = update_parts(updates, clients)
        changes = self._changes(parts, refs)
        if not changes:
            return updates, weights, metrics
        if lossy:  # the codec may have sent more than C (error feedback): clip what arrived
            factors = self.clipping.factors(changes, self.clip)
            changes = {k: v * factors[k].to(v)[:, None] for k, v in changes.items()}
        z = self.update_multiplier
        scale = m / self.expected if self.summed else 1.0
        if z == 0 and scale == 1 and not lossy:
            return updates, weights, metrics
        std = z * self.clip
        metrics["privacy/noise_std"] = std / self.expected if self.summed else std
        for name, v in changes.items():
            v = v * scale  # a new tensor: the noise goes on it in place
            if z > 0 and self.summed:  # one draw on the sum: each row carries ξ/E
                gen = streams.generator(self.seed, streams.PRIVACY_SERVER, round_, *_tag(name))
                v.add_(gaussian(gen, v.shape[1], std / self.expected, v)[None, :])
            elif z > 0:  # a draw per upload, all at once, each from its client's stream
                keys = _noise_keys(self.seed, streams.PRIVACY_SERVER, round_, clients, name)
                add_gaussian_rows(v, keys, std)
            changes[name] = v
        out = self._rebuild(parts, changes, refs)
        return parts_updates(out, clients), weights, metrics

    def empty_release(
        self, round_: int, received: Message | None
    ) -> tuple[Mapping[int, Message], dict[int, float], dict[str, float]]:
        """Step 3 for an empty Poisson cohort: central DP releases the noise alone.

        The analysed mechanism adds N(0, z²C²) to the sum of the cohort's clipped uploads,
        empty or not, and divides by E: the server gets one row ξ/E of weight 1 (a server
        that reads the mean reads only Σ ω_n u_n, not who sent it; client 0's id), drawn from
        the stream a non-empty round's noise comes from. A "model" part is its reference, what
        a client would have received, plus ξ/E.

        Args:
            round_: the round.
            received: what a client would receive this round (the algorithm's downlink,
                whose parts are an upload's: every mean-reading algorithm uploads a change of
                what it receives); None: the algorithm sends nothing, and nothing is released.

        Returns:
            As :meth:`server_side`: the updates and weights (none without noise, a server
            that reads each upload, or nothing received), and the round's metrics.
        """
        metrics = {"privacy/clip": self.clip}
        z = self.update_multiplier
        if not self.summed or z == 0 or received is None:
            return {}, {}, metrics
        parts = {k: v[None] for k, v in _parts(received).items()}
        refs = self.references(parts, parts, torch.zeros(0))
        std = z * self.clip / self.expected
        changes = {}
        for name, stack in self._changes(parts, refs).items():
            v = torch.zeros_like(stack)
            gen = streams.generator(self.seed, streams.PRIVACY_SERVER, round_, *_tag(name))
            v.add_(gaussian(gen, v.shape[1], std, v)[None, :])
            changes[name] = v
        if not changes:
            return {}, {}, metrics
        metrics["privacy/noise_std"] = std
        out = self._rebuild(parts, changes, refs)
        return parts_updates(out, [0]), {0: 1.0}, metrics

    def end_round(
        self, round_: int, clients: list[int], uploaded: bool, counts: dict[str, float]
    ) -> dict[str, float]:
        """Count the round, update the adaptive clip from its noised count; ε so far.

        Args:
            round_: the round.
            clients: who uploaded (the whole cohort, every rank's).
            uploaded: whether the cohort sent anything (an algorithm that never uploads,
                local training, spends no privacy; an empty cohort's round still counts).
            counts: :meth:`client_side`'s counts, summed over the ranks.
        """
        count = len(clients)
        out = {}
        if counts.get("privacy/uploads"):
            for key, whole in counts.items():  # the uploads, then each part (part_clip)
                if key.startswith("privacy/unclipped"):
                    name = key.replace("privacy/unclipped", "privacy/clipped", 1)
                    out[name] = 1 - whole / counts["privacy/uploads"]
        if uploaded and clients:
            self.participations[torch.tensor(clients, dtype=torch.int64)] += 1
        if count > 0 and not uploaded:
            self._uploads_nothing = True
        if not self._uploads_nothing:
            self.released += 1
        if self.settings.adaptive:  # an empty cohort's noised count too: b̄ = noise / E + ½
            gen = streams.generator(self.seed, streams.PRIVACY_SERVER, round_, _COUNT)
            noise = float(torch.randn(1, generator=gen, dtype=torch.float64)) * self.count_stddev
            self.clip = adaptive_clip(
                self.clip,
                counts.get("privacy/unclipped", 0.0),
                count,
                self.expected,
                noise,
                self.settings.target_quantile,
                self.settings.clip_lr,
            )
        return {**out, "privacy/epsilon": self.epsilon(self.released)}

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the clip bound and each client's participations."""
        return {
            "clip": torch.tensor([self.clip], dtype=torch.float64),
            "released": torch.tensor([self.released], dtype=torch.int64),
            "participations": self.participations.clone(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`."""
        if "clip" in state:
            self.clip = float(state["clip"][0])
        if "released" in state:
            self.released = int(state["released"][0])
        if "participations" in state:
            self.participations = state["participations"].to("cpu", torch.int64).clone()

    def describe(self) -> str:
        """One line on what the run privatises, for the run's start (the ``fedexp.privacy`` tag).

        Made of the settings and the calibrated z alone, never of the state (the adaptive C
        it starts from, not the current one), so that a resumed run's tag is the first's.
        """
        s = self.settings
        where = "the sum" if self.summed else "each upload"
        text = (
            f"privacy: {s.mode} DP, C={s.clip:g}{' (adaptive, initial)' if s.adaptive else ''}, "
            f"z={self.noise_multiplier:.4g} on {where}, {s.sampling} sampling, δ={s.delta:g}, "
            f"ε by {self.plan().accountant.upper()}"
        )
        if self.clipping.describe():
            text += f"; clipped per part: {self.clipping.describe()}"
        if self.unprotected:
            text += f"; not covered: {', '.join(self.unprotected)}"
        return text
