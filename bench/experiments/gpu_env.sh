# Sourced by the GPU machine's scripts from the repo root: the tuner's wheels (optuna,
# SQLAlchemy, alembic: .whl, carried, the GPU image has none) into /tmp/site when they are not
# importable, this checkout on PYTHONPATH, unbuffered output.
# One wheel at a time: the binary ones are carried for this machine's Python and the image's
# (3.12 in session 30), and pip refuses a whole install for one wheel of another Python.
if [ -d .whl ] && ! python3 -c "import optuna, sqlalchemy" 2>/dev/null; then
    for wheel in .whl/*.whl; do
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$wheel" 2>/dev/null || true
    done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
