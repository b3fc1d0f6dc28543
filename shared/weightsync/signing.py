"""Who may publish weights: only the holder of the run's Ed25519 signing key — the trainer. Every
manifest is signed over its canonical bytes (the signature field empty), its run id included, so
a version can come neither from anyone else nor from another run; the weight-sync service and
every replica verify with the public key alone, which is no secret (docs/security.md).

Keys are files of 64 hexadecimal characters: the 32-byte private seed (the trainer's
`signing_key_file`) and the 32-byte public key (`verify_key_file` of weight-sync and the
replicas). `steadyrl keys DIR` makes a pair; `steadyrl run` makes one per run.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runtime.private_files import write_private
from shared.weightsync.base import WeightError


def _read_hex(path: Path, what: str) -> bytes:
    try:
        raw = bytes.fromhex(Path(path).read_text().strip())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what} {path}: not a file of 64 hexadecimal characters ({exc})") from None
    if len(raw) != 32:
        raise ValueError(f"{what} {path}: {len(raw)} bytes, an Ed25519 key has 32")
    return raw


def canonical(manifest: pb.WeightManifest) -> bytes:
    """The bytes a signature covers: the manifest without its signature, serialised deterministically."""
    unsigned = pb.WeightManifest()
    unsigned.CopyFrom(manifest)
    unsigned.signature = b""
    return unsigned.SerializeToString(deterministic=True)


class Signer:
    """The trainer's side: stamps a manifest with the run and its instance, and signs it."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str = "", instance: str = "") -> None:
        self.key = key
        self.run_id = run_id
        self.instance = instance  # the run's instance (shared/runstore/run_instance.py)

    @classmethod
    def from_file(cls, path: Path, run_id: str = "", instance: str = "") -> Signer:
        return cls(Ed25519PrivateKey.from_private_bytes(_read_hex(path, "signing key")), run_id, instance)

    def sign(self, manifest: pb.WeightManifest) -> pb.WeightManifest:
        manifest.run_id = self.run_id
        manifest.run_instance = self.instance
        manifest.signature = self.key.sign(canonical(manifest))
        return manifest

    def public_hex(self) -> str:
        return self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def verifier_of(settings, run_id: str = "", instance: str = "") -> Verifier | None:
    """The verifier of a service's `VerifiedWeights` fields (None: unsigned_weights)."""
    return None if settings.unsigned_weights else Verifier.from_file(settings.verify_key_file, run_id, instance)


class Verifier:
    """Weight-sync's and a replica's side: a manifest is the run's trainer's, signed for this run and
    this instance of it, or a WeightError."""

    def __init__(self, key: Ed25519PublicKey, run_id: str = "", instance: str = "") -> None:
        self.key = key
        self.run_id = run_id
        self.instance = instance  # empty: not checked (a verifier that does not know it yet)

    @classmethod
    def from_file(cls, path: Path, run_id: str = "", instance: str = "") -> Verifier:
        return cls(Ed25519PublicKey.from_public_bytes(_read_hex(path, "verify key")), run_id, instance)

    def check(self, manifest: pb.WeightManifest) -> None:
        if not manifest.signature:
            raise WeightError(f"version {manifest.version} is unsigned: only the run's trainer publishes weights")
        try:
            self.key.verify(manifest.signature, canonical(manifest))
        except InvalidSignature:
            raise WeightError(f"version {manifest.version}: the signature is not the run's trainer's") from None
        if self.run_id and manifest.run_id != self.run_id:
            raise WeightError(f"version {manifest.version} belongs to run {manifest.run_id!r}, not {self.run_id!r}")
        if self.instance and manifest.run_instance != self.instance:
            raise WeightError(
                f"version {manifest.version} belongs to another instance of run {manifest.run_id!r} (an earlier "
                "run's version, replayed): only this run's are taken"
            )


def write_key_pair(
    directory: Path,
    private_name: str = "weights-signing-key",
    public_name: str = "weights-verify-key",
    replace: bool = False,
) -> tuple[Path, Path]:
    """A fresh key pair as two files in `directory` (made 0700 when new; the private key mode 0600,
    the public 0644), each written whole before it is in place (`write_private`): their paths.
    FileExistsError when either is there and not `replace`: a deployment's key is never replaced by
    accident (its replicas would refuse every version signed with the new one)."""
    key = Ed25519PrivateKey.generate()
    private = directory / private_name
    public = directory / public_name
    if not replace:
        for path in (private, public):
            if path.exists() or path.is_symlink():
                raise FileExistsError(f"{path} exists: it is not replaced (pass --force to replace it)")
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    write_private(private, key.private_bytes_raw().hex() + "\n", 0o600, replace)
    write_private(public, Signer(key).public_hex() + "\n", 0o644, replace)
    return private, public
