#!/usr/bin/env bash
# Entrypoint of every NPU image: load the CANN environment, then run the command.
# `docker run IMAGE ARGS...` -> ARGS run with the toolkit (and NNAL, when installed) sourced.
#
# No `set -e`/`set -u`: the set_env.sh scripts are not written for them, and the CANN image
# already bakes the toolkit variables in with ENV, so a hiccup there must not stop the command.

# shellcheck source=/dev/null
. /usr/local/Ascend/ascend-toolkit/set_env.sh
if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then
    # shellcheck source=/dev/null
    . /usr/local/Ascend/nnal/atb/set_env.sh --cxx_abi="${ATB_CXX_ABI:-1}"
fi

exec "$@"
