"""Print the W&B API key for the head's `ray start` (cluster/ray-cluster.yaml), read from AWS Secrets Manager, which
only the head's instance role may read (cluster/README.md): the key is never a file on a node.

    python cluster/wandb_key.py REGION [SECRET_ID]      # SECRET_ID: treepo-ray/wandb-api-key unless given

When the secret cannot be read (no boto3, no permission, no such secret) it prints nothing and one line on stderr
saying why, and exits 0: the head still starts, and the job logs to W&B offline, into the run directory.
"""

from __future__ import annotations

import sys

DEFAULT_SECRET = "treepo-ray/wandb-api-key"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    region, secret_id = argv[0], argv[1] if len(argv) == 2 else DEFAULT_SECRET
    try:
        import boto3

        answer = boto3.client("secretsmanager", region_name=region).get_secret_value(SecretId=secret_id)
    except Exception as exc:  # whatever stops the read, the head starts and says why once
        print(f"wandb_key.py: cannot read the secret {secret_id} in {region} ({type(exc).__name__}: {exc}); "
              "W&B will log offline", file=sys.stderr)
        return 0
    print(answer["SecretString"].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
