"""`python -m encoder_service.local.testmodels`: build test models (scripts/setup_env.py)."""

from encoder_service.local.testmodels import main

main()
