"""The command line recorded in result files (cli_options.invoked_command)."""
from sparseconv.cli_options import invoked_command


def test_the_recorded_command_is_one_a_user_can_type_again():
    # `python -m sparseconv` runs sparseconv/__main__.py: recorded as the console script
    assert invoked_command(["/x/sparseconv/__main__.py", "bench", "--network", "resnet50"]) == \
        "sparseconv bench --network resnet50"
    assert invoked_command(["/usr/bin/sparseconv", "bench", "--variants", "sparseconv,compile TF32"]) == \
        "sparseconv bench --variants 'sparseconv,compile TF32'"
    assert invoked_command(["bench/run.py", "--batch", "1"]) == "python bench/run.py --batch 1"
