"""pip's build of the Python package kfac (docs/python.md, "Building and installing").

    python3 -m pip install --no-build-isolation .

builds the extension kfac._kfac (python/src/kfac_python.cpp, self_tuning.cpp) against the torch installed in the
environment (torch.utils.cpp_extension) and installs it with every module under python/kfac/.
Kokkos, Kokkos Kernels, LAPACKE/BLAS and MPI are found by CMake (python/deps/CMakeLists.txt), so
the extension gets the flags, libraries and KFAC_HAVE_* definitions of the CMake build.

Environment variables:
    KFAC_BUILD_OPT      the optimization flag (default -O3; -O1 builds in 60% of the time, -O0 in half)
    KFAC_MPI            1: with MPI (mpi_comm=), an error if CMake finds none; 0: without;
                        unset: with MPI when CMake finds it, as the CMake build does
    KFAC_PIP_BUILD_DIR  where the build's files go (default: build/pip in the source tree)
    KFAC_CMAKE_ARGS     more arguments for the CMake step, e.g. -DKokkos_ROOT=/opt/kokkos
    CMAKE_CXX_COMPILER_LAUNCHER  e.g. ccache, as for CMake (with torch's ninja build, the default)
Kokkos and the others are found as CMake finds them: CMAKE_PREFIX_PATH and <Package>_ROOT apply.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import find_packages
from setuptools import setup

ROOT = pathlib.Path(__file__).resolve().parent

try:
    from torch.utils.cpp_extension import BuildExtension
    from torch.utils.cpp_extension import CppExtension
except ImportError:
    sys.exit('kfac: the extension is built against the torch it will run with, and none imports here. Install '
             'torch first, then build without isolation: pip install --no-build-isolation .')


def version() -> str:
    """KFAC_VERSION_STRING of include/kfac/config.hpp, the one place the version is written."""
    text = (ROOT / 'include' / 'kfac' / 'config.hpp').read_text()
    return re.search(r'#define KFAC_VERSION_STRING "([^"]+)"', text).group(1)


def refuse_kfac_pytorch() -> None:
    """kfac-pytorch installs the same import package, kfac: one would overwrite the other's files."""
    try:
        other = importlib.metadata.distribution('kfac-pytorch')
    except importlib.metadata.PackageNotFoundError:
        return
    if os.environ.get('KFAC_ALLOW_KFAC_PYTORCH') != '1':
        sys.exit(f'kfac: kfac-pytorch {other.version} is installed here and also provides the import package kfac. '
                 'Uninstall it first (pip uninstall kfac-pytorch), or set KFAC_ALLOW_KFAC_PYTORCH=1 to build anyway '
                 '(e.g. a wheel for another environment).')


def cmake_flags(build_dir: str) -> dict[str, list]:
    """Configures python/deps with CMake and reads the probe target's compile and link lines from
    CMake's file API: {'defines': [(name, value)], 'includes': [dir], 'compile': [flag], 'link': [arg]}."""
    query = pathlib.Path(build_dir, '.cmake', 'api', 'v1', 'query', 'codemodel-v2')
    query.parent.mkdir(parents=True, exist_ok=True)
    query.touch()
    args = ['cmake', '-S', str(ROOT / 'python' / 'deps'), '-B', build_dir, '-DCMAKE_BUILD_TYPE=Release',
            '-DCMAKE_CXX_FLAGS_RELEASE=', '-DKFAC_ENABLE_TESTS=OFF', '-DKFAC_ENABLE_EXAMPLES=OFF',
            '-DKFAC_ENABLE_BENCHMARKS=OFF', '-DKFAC_ENABLE_EIGEN=OFF', '-DKFAC_ENABLE_PYTHON=OFF',
            '-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON', '-DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON',
            f'-DPython3_EXECUTABLE={sys.executable}']
    mpi = os.environ.get('KFAC_MPI', '')
    if mpi == '0':
        args.append('-DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON')
    args += shlex.split(os.environ.get('KFAC_CMAKE_ARGS', ''))
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)

    reply = pathlib.Path(build_dir, '.cmake', 'api', 'v1', 'reply')
    index = json.loads(max(reply.glob('index-*.json')).read_text())
    codemodel = json.loads((reply / index['reply']['codemodel-v2']['jsonFile']).read_text())
    entry = next(t for t in codemodel['configurations'][0]['targets'] if t['name'] == 'kfac_pip_probe')
    target = json.loads((reply / entry['jsonFile']).read_text())
    group = target['compileGroups'][0]

    flags: dict[str, list] = {'defines': [], 'includes': [], 'compile': [], 'link': []}
    for d in group.get('defines', []):
        name, _, value = d['define'].partition('=')
        if name != 'kfac_pip_probe_EXPORTS':  # CMake's export macro of the probe, not kfac's
            flags['defines'].append((name, value or None))
    for inc in group.get('includes', []):
        if inc.get('isSystem'):
            flags['compile'] += ['-isystem', inc['path']]
        else:
            flags['includes'].append(inc['path'])
    for f in group.get('compileCommandFragments', []):
        flags['compile'] += shlex.split(f['fragment'])
    for f in target['link']['commandFragments']:
        if f['role'] in ('libraries', 'libraryPath'):
            flags['link'] += shlex.split(f['fragment'])
    has_mpi = ('KFAC_HAVE_MPI', '1') in flags['defines']
    if mpi == '1' and not has_mpi:
        sys.exit('kfac: KFAC_MPI=1 but CMake found no MPI (Debian: libopenmpi-dev)')
    print(f'kfac: {"with" if has_mpi else "without"} MPI; defines {flags["defines"]}', flush=True)
    return flags


def launcher_script(launcher: str, build_dir: str) -> str:
    """A compiler launcher (ccache) under CMake's name for it, CMAKE_CXX_COMPILER_LAUNCHER (a ;-list).
    torch's ninja build takes the compiler from CXX as one program, which it checks is gcc by its
    name: a script named as the compiler it runs, that runs it through the launcher."""
    compiler = os.path.realpath(shutil.which(os.environ.get('CXX', 'c++')))
    script = pathlib.Path(build_dir, 'launcher', os.path.basename(compiler))
    script.parent.mkdir(parents=True, exist_ok=True)
    command = ' '.join(shlex.quote(a) for a in launcher.split(';') + [compiler])
    script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    script.chmod(0o755)
    return str(script)


class BuildKfacExtension(BuildExtension):
    """torch's BuildExtension, plus the flags CMake finds for kfac's dependencies."""

    def build_extensions(self) -> None:
        flags = cmake_flags(os.path.join(os.path.abspath(self.build_temp), 'deps'))
        for ext in self.extensions:
            ext.define_macros += flags['defines']
            ext.include_dirs += flags['includes']
            ext.extra_compile_args += flags['compile']
            ext.extra_link_args += flags['link']
        # A virtual environment's include folder is listed whether or not it exists: an absent one
        # only makes the command differ between environments, and ccache miss.
        self.compiler.include_dirs = [d for d in self.compiler.include_dirs if os.path.isdir(d)]
        launcher = os.environ.get('CMAKE_CXX_COMPILER_LAUNCHER')
        if launcher and self.use_ninja:
            os.environ['CXX'] = launcher_script(launcher, os.path.abspath(self.build_temp))
        super().build_extensions()


refuse_kfac_pytorch()
build_dir = os.path.join(ROOT, os.environ.get('KFAC_PIP_BUILD_DIR', 'build/pip'))  # relative: to the source tree
os.makedirs(build_dir, exist_ok=True)
setup(
    version=version(),
    packages=find_packages(where='python', include=['kfac', 'kfac.*']),
    package_dir={'': 'python'},
    ext_modules=[
        CppExtension(
            'kfac._kfac', ['python/src/kfac_python.cpp', 'python/src/self_tuning.cpp'],
            # After the interpreter's own flags (Debian's carry -g -O2): no debug information, which
            # would make the module hundreds of MB; pybind11's advice of hidden symbols, as in the CMake build.
            extra_compile_args=['-std=c++17', os.environ.get('KFAC_BUILD_OPT', '-O3'), '-g0', '-fvisibility=hidden',
                                '-Wno-unused-parameter'])
    ],
    cmdclass={'build_ext': BuildKfacExtension},
    options={'build': {'build_base': build_dir}, 'egg_info': {'egg_base': build_dir}},
)
