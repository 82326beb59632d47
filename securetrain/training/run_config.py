"""Config for ``securetrain train``: the engine's :class:`TrainingConfig` plus the built-in
synthetic dataset and MLP, so the command runs with no data.

YAML example::

    training: {epochs: 3, batch_size: 64, output_dir: runs/demo}
    data: {samples: 4096, features: 32, classes: 4}
    model: {hidden: 128}

Environment overrides: ``SECURETRAIN_TRAINING__EPOCHS=5``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from securetrain.training.config import TrainingConfig


class SyntheticDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: PositiveInt = 2048
    features: PositiveInt = 32
    classes: int = Field(4, ge=2)
    seed: int = Field(0, ge=0)
    noise: float = Field(1.0, ge=0.0)


class MlpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hidden: PositiveInt = 64
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class TrainRunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    training: TrainingConfig = Field(default_factory=lambda: TrainingConfig(epochs=3, batch_size=64))
    data: SyntheticDataConfig = Field(default_factory=SyntheticDataConfig)
    model: MlpConfig = Field(default_factory=MlpConfig)
