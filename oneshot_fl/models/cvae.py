"""Conditional VAEs of FedMHO's resource-constrained clients (and the FedCVAE baseline).

Each CVAE is an `encoder` (stays on the client) and a `decoder` (the only part uploaded). The
condition is the one-hot class, concatenated to the decoder's input and to the encoder's input
(MLP) or hidden features (conv). Outputs are Sigmoid means in [0, 1] (inputs are not normalised).
Architectures follow the FedMHO code (Yao et al., "FedMHO: Heterogeneous One-Shot Federated Learning
Towards Resource-Constrained Edge Devices", Sec. 4.1.1 and Tables I-II):

  cvae-mlp    CVAE-small for 28x28 grey: 784+C -> 256 -> L;  L+C -> 256 -> 784. Default L = 2
              (204,816 decoder parameters on MNIST; 408.06 K FLOPs, Table II).
  cvae-conv   CVAE-small with conv layers: 32px (SVHN code; 150,171 decoder parameters with
              L = 20) or 28px (EMNIST code). Default L = 20.
  cvae-large  FEDCVAE's CVAE-large (3.6 M decoder parameters on MNIST). Default L = 20.

The server validates an uploaded decoder (upload role "decoder", oneshot_fl.uploads) against
`expected_decoder_state(arch, input shape, classes, latent size)` and `decoder_settings` (its latent size).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.errors import ConfigError

HIDDEN = 256
MAX_LATENT_DIM = 1024


def one_hot(labels: torch.Tensor, num_classes: int, like: torch.Tensor) -> torch.Tensor:
    return F.one_hot(labels.long(), num_classes).to(like.dtype)


def _conv_plan(image_size: int) -> tuple[tuple[int, ...], int]:
    """Channels of the stride-2 conv stages and the base side: 32px -> (8,16,32) at 4x4, 28px -> (8,16) at 7x7."""
    if image_size == 32:
        return (8, 16, 32), 4
    if image_size == 28:
        return (8, 16), 7
    raise ValueError(f"cvae-conv: image size {image_size} not supported (28 or 32)")


# --- decoders: (z, labels) -> images in [0, 1] ------------------------------------------------

class Decoder(nn.Module):
    """Base of every decoder: conditioning on the one-hot label, sampling z ~ N(0, I)."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        super().__init__()
        self.in_channels, self.image_size = in_channels, image_size
        self.num_classes, self.latent_dim = num_classes, latent_dim

    def decode(self, zc: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.cat([z, one_hot(labels, self.num_classes, z)], dim=1))

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Images of the given classes from z ~ N(0, I); the Sigmoid mean is the image (no Bernoulli draw)."""
        z = torch.randn(len(labels), self.latent_dim, generator=generator).to(labels.device)
        return self(z, labels)


class MLPDecoder(Decoder):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        super().__init__(in_channels, image_size, num_classes, latent_dim)
        self.fc1 = nn.Linear(latent_dim + num_classes, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, in_channels * image_size * image_size)

    def decode(self, zc):
        out = torch.sigmoid(self.fc2(F.relu(self.fc1(zc))))
        return out.view(-1, self.in_channels, self.image_size, self.image_size)


class ConvDecoder(Decoder):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        super().__init__(in_channels, image_size, num_classes, latent_dim)
        channels, self.base = _conv_plan(image_size)
        self.top = channels[-1]
        self.fc1 = nn.Linear(latent_dim + num_classes, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, self.top * self.base * self.base)
        outs = list(channels[::-1][1:]) + [in_channels]  # 32 -> 16 -> 8 -> C (32px)
        self.deconvs = nn.ModuleList(nn.ConvTranspose2d(cin, cout, 4, stride=2, padding=1)
                                     for cin, cout in zip(channels[::-1], outs))

    def decode(self, zc):
        h = F.relu(self.fc2(F.relu(self.fc1(zc)))).view(-1, self.top, self.base, self.base)
        for i, deconv in enumerate(self.deconvs):
            h = deconv(h)
            h = torch.sigmoid(h) if i == len(self.deconvs) - 1 else F.relu(h)
        return h


class LargeDecoder(Decoder):
    """FEDCVAE's CVAE-large decoder: FC to 256 x s x s, then ConvT3 + bilinear x2 upsampling."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        super().__init__(in_channels, image_size, num_classes, latent_dim)
        self.side = image_size // 4
        self.fc1 = nn.Linear(latent_dim + num_classes, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 256 * self.side * self.side)
        self.deconv1 = nn.ConvTranspose2d(256, 128, 3, padding=1)
        self.deconv2 = nn.ConvTranspose2d(128, 64, 3, padding=1)
        self.deconv3 = nn.ConvTranspose2d(64, in_channels, 3, padding=1)

    def decode(self, zc):
        h = F.relu(self.fc2(F.relu(self.fc1(zc)))).view(-1, 256, self.side, self.side)
        h = F.interpolate(F.relu(self.deconv1(h)), scale_factor=2, mode="bilinear", align_corners=False)
        h = F.interpolate(F.relu(self.deconv2(h)), scale_factor=2, mode="bilinear", align_corners=False)
        return torch.sigmoid(self.deconv3(h))


# --- encoders: (x, labels) -> (mu, logvar); never leave the client --------------------------

class MLPEncoder(nn.Module):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(in_channels * image_size * image_size + num_classes, HIDDEN)
        self.mu = nn.Linear(HIDDEN, latent_dim)
        self.logvar = nn.Linear(HIDDEN, latent_dim)

    def forward(self, x, labels):
        h = F.relu(self.fc(torch.cat([x.flatten(1), one_hot(labels, self.num_classes, x)], dim=1)))
        return self.mu(h), self.logvar(h)


class _ConvEncoderBase(nn.Module):
    """Convolutions -> fc -> [features, one-hot label] -> (mu, logvar); subclasses give the convolutions."""

    def __init__(self, convs: nn.Sequential, flat_features: int, num_classes: int, latent_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.convs = convs
        self.fc = nn.Linear(flat_features, HIDDEN)
        self.mu = nn.Linear(HIDDEN + num_classes, latent_dim)
        self.logvar = nn.Linear(HIDDEN + num_classes, latent_dim)

    def forward(self, x, labels):
        h = F.relu(self.fc(self.convs(x).flatten(1)))
        h = torch.cat([h, one_hot(labels, self.num_classes, h)], dim=1)
        return self.mu(h), self.logvar(h)


class ConvEncoder(_ConvEncoderBase):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        channels, base = _conv_plan(image_size)
        layers: list[nn.Module] = []
        for cin, cout in zip((in_channels, *channels[:-1]), channels):
            layers += [nn.Conv2d(cin, cout, 4, stride=2, padding=1), nn.ReLU()]
        super().__init__(nn.Sequential(*layers), channels[-1] * base * base, num_classes, latent_dim)


class LargeEncoder(_ConvEncoderBase):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int):
        convs = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        super().__init__(convs, 256 * (image_size // 4) ** 2, num_classes, latent_dim)


LOGVAR_BOUND = 20.0


class CVAE(nn.Module):
    """Encoder + decoder; forward(x, y) -> (reconstruction, mu, logvar) with the reparameterisation trick."""

    def __init__(self, encoder: nn.Module, decoder: Decoder):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    @property
    def latent_dim(self) -> int:
        return self.decoder.latent_dim

    def forward(self, x: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None = None):
        mu, logvar = self.encoder(x, labels)
        # Adam at the paper's lr (5e-2 on MNIST) can drive a log-variance past 88, where exp overflows float32 and
        # the KL term of Eq. 3 becomes inf (seen on a one-shot MNIST NIID-Bench 0.1 client). A variance outside
        # e^-20..e^20 means nothing for a unit-Gaussian prior; inside, the clamp is the identity.
        logvar = logvar.clamp(-LOGVAR_BOUND, LOGVAR_BOUND)
        eps = torch.randn(mu.shape, generator=generator).to(mu) if generator is not None else torch.randn_like(mu)
        z = mu + eps * torch.exp(0.5 * logvar)
        return self.decoder(z, labels), mu, logvar


def elbo_per_example(recon: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
                     kl_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each example's negative ELBO (FedMHO Eq. 3, code form): BCE summed over its pixels
    + kl_weight * KL(q || N(0, I)). Returns (loss, recon term, KL term), each of shape (batch,)."""
    bce = F.binary_cross_entropy(recon, x, reduction="none").flatten(1).sum(dim=1)
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1)
    return bce + kl_weight * kld, bce, kld


def elbo_loss(recon: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
              kl_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The negative ELBO averaged over the batch (as the FedMHO code trains it): (loss, recon term, KL term)."""
    loss, bce, kld = elbo_per_example(recon, x, mu, logvar, kl_weight)
    return loss.mean(), bce.mean(), kld.mean()


# --- registry ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CVAEArch:
    encoder: Callable[..., nn.Module]
    decoder: Callable[..., Decoder]
    default_latent_dim: int


CVAE_ARCHITECTURES: dict[str, CVAEArch] = {
    "cvae-mlp": CVAEArch(MLPEncoder, MLPDecoder, 2),
    "cvae-conv": CVAEArch(ConvEncoder, ConvDecoder, 20),
    "cvae-large": CVAEArch(LargeEncoder, LargeDecoder, 20),
}


def check_cvae_arch(name: str, where: str = "cvae.arch") -> str:
    if name not in CVAE_ARCHITECTURES:
        raise ConfigError(f"{where}={name!r} is not a known CVAE architecture; choose one of: "
                          f"{', '.join(CVAE_ARCHITECTURES)}")
    return name


def default_cvae_arch(input_shape: tuple[int, int, int]) -> str:
    """MLP CVAE for 28x28 grey images, conv CVAE for 32x32 colour ones (the FedMHO code's choice)."""
    channels, size, _ = input_shape
    return "cvae-mlp" if (channels, size) == (1, 28) else "cvae-conv"


def resolve_latent_dim(name: str, latent_dim: int) -> int:
    """0 = the architecture's default latent size."""
    return latent_dim or CVAE_ARCHITECTURES[check_cvae_arch(name)].default_latent_dim


def _check_shape(name: str, input_shape: tuple[int, int, int]) -> tuple[int, int]:
    channels, height, width = input_shape
    if height != width or height not in (28, 32):
        raise ValueError(f"{name}: input {input_shape} not supported (28x28 or 32x32 images)")
    return channels, height


def build_cvae(name: str, input_shape: tuple[int, int, int], num_classes: int, latent_dim: int = 0,
               seed: int | None = None) -> CVAE:
    arch = CVAE_ARCHITECTURES[check_cvae_arch(name)]
    channels, size = _check_shape(name, input_shape)
    latent = resolve_latent_dim(name, latent_dim)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return CVAE(arch.encoder(channels, size, num_classes, latent),
                    arch.decoder(channels, size, num_classes, latent))


def build_decoder(name: str, input_shape: tuple[int, int, int], num_classes: int, latent_dim: int) -> Decoder:
    """The decoder alone, as the server rebuilds it from an upload."""
    arch = CVAE_ARCHITECTURES[check_cvae_arch(name)]
    channels, size = _check_shape(name, input_shape)
    return arch.decoder(channels, size, num_classes, resolve_latent_dim(name, latent_dim))


@lru_cache(maxsize=64)
def expected_decoder_state(name: str, input_shape: tuple[int, int, int], num_classes: int,
                           latent_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """state_dict key -> (shape, dtype) of a decoder, without allocating its weights."""
    with torch.device("meta"):
        decoder = build_decoder(name, tuple(input_shape), num_classes, latent_dim)
    return {k: (tuple(v.shape), v.dtype) for k, v in decoder.state_dict().items()}


def decoder_settings(meta: dict) -> dict:
    """Validate the decoder role's settings sent in the upload's meta record (its latent size)."""
    latent = meta.get("latent-dim")
    if isinstance(latent, bool) or not isinstance(latent, int) or not 1 <= latent <= MAX_LATENT_DIM:
        raise ValueError(f"decoder upload needs an integer latent-dim in 1..{MAX_LATENT_DIM}, got {latent!r}")
    return {"latent_dim": latent}
