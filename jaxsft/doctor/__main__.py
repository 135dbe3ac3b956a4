"""`python -m jaxsft.doctor RUN_DIR`, as `jaxsft doctor RUN_DIR`."""

from jaxsft.cli import console

if __name__ == "__main__":
  console("doctor")
