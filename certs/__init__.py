"""Development certificates: a small CA and a localhost leaf, made with `cryptography`.

Generated keys live in a git-ignored folder (`certs/dev/` by default, or `$QUICEDGE_CERTS_DIR`).
"""

from certs.dev import DevCertificates, default_dir, ensure_dev_certificates

__all__ = ["DevCertificates", "default_dir", "ensure_dev_certificates"]
