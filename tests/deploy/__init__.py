"""The deploy lane (`./run.sh test-deploy`, marker `deploy`): the compose stack for real."""
