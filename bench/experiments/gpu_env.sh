# Sourced by the GPU machine's scripts from the repo root: the tuner's wheels (optuna,
# SQLAlchemy, alembic: .whl, carried, the GPU image has none) into /tmp/site when they are not
# importable, this checkout on PYTHONPATH, unbuffered output.
if [ -d .whl ] && ! python3 -c "import optuna, sqlalchemy" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
