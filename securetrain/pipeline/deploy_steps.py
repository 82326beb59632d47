"""Prefect pull steps that read their settings on the worker, when a flow run starts.

``prefect deploy`` resolves every ``{{ $VAR }}`` in ``prefect.yaml`` with the *deployer's*
environment and stores the result in the deployment (a deployer's home folder, or a password).
These steps take the *name* of a variable instead and read it from the worker's environment::

    pull:
      - securetrain.pipeline.deploy_steps.set_working_directory_from_env:
          variable: SECURETRAIN_HOME
"""

from __future__ import annotations

import os
from pathlib import Path

from securetrain.errors import ConfigError


def set_working_directory_from_env(variable: str = "SECURETRAIN_HOME") -> dict[str, str]:
    """``chdir`` to the folder the worker's ``$variable`` names (the securetrain checkout/image root)."""
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"{variable} is not set on this worker",
                          hint=f"set {variable} to the folder holding flows/ and examples/ in the worker's environment")
    directory = Path(value).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"{variable}: {directory} is not a folder on this worker", hint=f"fix {variable}")
    os.chdir(directory)
    return {"directory": str(directory.resolve())}
