"""`report_to`: where training's per-step numbers go besides history.json and the log line.

    none         nowhere else
    tensorboard  event files under <run>/tensorboard (torch's SummaryWriter; the `tracking` extra installs it)
    wandb        a Weights & Biases run under <run>/wandb, named and resumed by the run key; W&B's own settings
                 (WANDB_MODE=offline, WANDB_PROJECT, the API key) come from its environment variables
Each number of a step is its own series (`train/loss`, `train/crepa_loss`, ...), so a regulariser's term is plotted
apart from the flow loss. Neither package is required: asking for one that is missing fails before training, naming
the `pip install` to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

REPORT_TO = ("tensorboard", "wandb", "none")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Sink(Protocol):
    def log(self, row: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NoSink:
    def log(self, row: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, run_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1)  # a resume drops lost steps

    def log(self, row: dict[str, float], step: int) -> None:
        for name, value in row.items():
            self.writer.add_scalar(f"train/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        # id = the run key: a resumed run continues its W&B run (steps it logged after the checkpoint are ignored by
        # W&B, which never goes back in steps)
        self.run = wandb.init(project="loraflow", name=run_dir.name, id=run_dir.name, resume="allow",
                              dir=str(run_dir), config=config)

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log({f"train/{name}": value for name, value in row.items()}, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # finish returns before W&B's service has written the run's files; this waits for it


def open_sink(report_to: str, run_dir: Path, start: int, config: dict[str, Any] | None = None) -> Sink:
    """The sink of `report_to` for the run in `run_dir`, resuming after optimizer step `start`."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to {report_to!r} is not known; allowed: {', '.join(REPORT_TO)}")
    if report_to == "none":
        return NoSink()
    try:
        return TensorBoardSink(run_dir, start) if report_to == "tensorboard" else WandbSink(run_dir, config or {})
    except ImportError as exc:
        package = PACKAGES[report_to]
        raise ImportError(f"report_to: {report_to} needs the {package} package, which is not installed: "
                          f"`pip install {package}` (or `pip install loraflow[tracking]`), "
                          "or set report_to: none") from exc
