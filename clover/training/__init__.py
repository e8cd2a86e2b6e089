"""Training: offline data preparation (`data`, `bfcl`) and the block-diffusion trainer."""

from clover.training.config import LoraConfig, NoiseConfig, TrainConfig, load_train_config
from clover.training.batches import Batch, collate
from clover.training.objective import Noise, bd3_loss, reference_block_loss, sample_noise
from clover.training.trainer import Trainer, TrainResult, train

__all__ = ["Batch", "LoraConfig", "Noise", "NoiseConfig", "TrainConfig", "TrainResult", "Trainer", "bd3_loss",
           "collate", "load_train_config", "reference_block_loss", "sample_noise", "train"]
