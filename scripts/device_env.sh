# Source on the GPU machine (device tool): the Python packages its image lacks, carried
# as wheels in .devrun/whl, and a redis-server binary with its two libraries in .devrun/.
# Build .devrun here with scripts/make_devrun.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
export PATH=$PWD/.devrun/bin:$PATH
export LD_LIBRARY_PATH=$PWD/.devrun/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
