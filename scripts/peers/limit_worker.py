"""The hand-batched limit of ``scripts/bench_peers.py``'s tabular workload (issue 14).

FedAvg on logistic regression written as the fewest tensor operations a cohort's round can be:
every client's model a row of ``W [N, d]``, every step one gather of the N minibatches and two
batched matrix products (``torch.bmm``) for the logits and the analytic gradient of the binary
cross-entropy, the server's average one mean over the rows. Evaluation is one more ``bmm``
over every client's data: each client's accuracy and loss. No encoding, no byte counting, no
per-client Python: what a round of this workload costs at least on this machine.

    python scripts/peers/limit_worker.py --workload tabular --clients 1000 --rounds 5
"""

from __future__ import annotations

import time

import common
import torch


def main() -> None:
    """Run the batched rounds and print the result line."""
    parser = common.base_args(__doc__.split("\n")[0])
    parser.add_argument("--eval-rounds", type=int, default=3)
    args = parser.parse_args()
    if args.workload != "tabular":
        raise SystemExit("limit_worker: the hand-batched limit is written for --workload tabular")
    torch.set_num_threads(args.threads)
    clock = common.Clock()
    spec = common.WORKLOADS["tabular"]
    clients = common.all_clients("tabular", args.clients, args.seed)
    x = torch.stack([c[0] for c in clients])  # [N, n, d]
    y = torch.stack([c[1] for c in clients]).float()  # [N, n]
    num, n, d = x.shape
    model = common.make_model("tabular", args.seed)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # [d + 1]: weight, bias
    gen = torch.Generator().manual_seed(args.seed)
    x_flat, y_flat = x.reshape(num * n, d), y.reshape(-1)
    rows = torch.arange(num)[:, None] * n
    weights = torch.full((num,), 1.0 / num)  # samples-weighted: all equal
    x_np, y_np = x_flat.numpy(), y_flat.numpy()

    def take(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The minibatches' rows: NumPy's take on one thread (the CPU's fastest gather, as
        fedexp's ``take_rows``), else ``index_select`` (which shares them among threads)."""
        if args.threads == 1:
            i = flat.numpy()
            return torch.from_numpy(x_np.take(i, axis=0)), torch.from_numpy(y_np.take(i, axis=0))
        return x_flat.index_select(0, flat), y_flat.index_select(0, flat)

    def one_round(w: torch.Tensor) -> torch.Tensor:
        theta = w.expand(num, d + 1).clone()
        for _ in range(spec.steps):
            idx = torch.randint(n, (num, spec.batch), generator=gen)
            xb, yb = take((rows + idx).reshape(-1))
            xb, yb = xb.view(num, spec.batch, d), yb.view(num, spec.batch)
            z = torch.bmm(xb, theta[:, :d, None])[..., 0] + theta[:, d:]
            err = (torch.sigmoid(z) - yb) / spec.batch  # d(mean BCE)/dz
            grad_w = torch.bmm(err[:, None, :], xb)[:, 0]
            theta = theta - spec.lr * torch.cat([grad_w, err.sum(1, keepdim=True)], dim=1)
        return weights @ theta

    def evaluate(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = x @ w[:d] + w[d]  # [N, n]: one batched product
        acc = ((z > 0).float() == y).float().mean(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none")
        return acc, loss.mean(1)

    with torch.no_grad():
        for _ in range(args.rounds + 1):
            clock.round_start()
            w = one_round(w)
            clock.round_end()
        summary = clock.summary(args.clients)
        with_eval = []
        for _ in range(args.eval_rounds):
            start = time.perf_counter()
            w = one_round(w)
            acc, _ = evaluate(w)
            float(acc.mean())
            with_eval.append(time.perf_counter() - start)
    torch.nn.utils.vector_to_parameters(w, model.parameters())
    common.report(
        {
            "framework": "limit",
            "workload": "tabular",
            "clients": args.clients,
            "accuracy": common.accuracy(model, clients),
            "round_eval_s": sorted(with_eval)[len(with_eval) // 2],
            **summary,
        }
    )


if __name__ == "__main__":
    main()
