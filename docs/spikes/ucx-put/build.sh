#!/bin/sh
# build the spike against the libucp that ucxx loads (the libucx-cu12 wheel, UCX 1.21)
U=$(python -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')
cd "$(dirname "$0")" && gcc -O2 -Wall -o putspike putspike.c -I"$U/include" -L"$U/lib" -lucp -lucs -Wl,-rpath,"$U/lib"
