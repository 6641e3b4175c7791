# Finds the Kokkos targets kfac links, for both the build tree and the installed package.
# Debian's Trilinos packaging (Kokkos 3.4) needs two workarounds:
#  - Kokkos::kokkos carries the non-existent include dir /usr/lib/include, so the real
#    ${Kokkos_INCLUDE_DIRS} is added explicitly;
#  - Kokkos Kernels only provides the plain target trilinos_kokkoskernels (no namespaced target).
# Standalone Kokkos / Kokkos Kernels installs (3.x, 4.x) provide Kokkos::kokkoskernels.
# Drop include dirs that do not exist from Kokkos' imported targets (Debian lists
# /usr/lib/include), which otherwise make CMake's generate step fail for consumers.
foreach(tgt Kokkos::kokkos Kokkos::kokkoscore trilinos_kokkoscore trilinos_kokkoscontainers
            trilinos_kokkosalgorithms trilinos_kokkoskernels)
  if(TARGET ${tgt})
    get_target_property(dirs ${tgt} INTERFACE_INCLUDE_DIRECTORIES)
    if(dirs)
      set(kept "")
      foreach(d IN LISTS dirs)
        if(d MATCHES "^\\$<" OR EXISTS "${d}")
          list(APPEND kept "${d}")
        endif()
      endforeach()
      set_property(TARGET ${tgt} PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${kept}")
    endif()
  endif()
endforeach()
set(KFAC_KOKKOS_TARGETS Kokkos::kokkos)
set(KFAC_KOKKOS_INCLUDE_DIRS "")
if(TARGET Kokkos::kokkoskernels)
  list(APPEND KFAC_KOKKOS_TARGETS Kokkos::kokkoskernels)
elseif(TARGET trilinos_kokkoskernels)
  list(APPEND KFAC_KOKKOS_TARGETS trilinos_kokkoskernels)
  foreach(dir IN LISTS Kokkos_INCLUDE_DIRS KokkosKernels_INCLUDE_DIRS)
    get_filename_component(real "${dir}" REALPATH)
    if(EXISTS "${real}")
      list(APPEND KFAC_KOKKOS_INCLUDE_DIRS "${real}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES KFAC_KOKKOS_INCLUDE_DIRS)
else()
  message(FATAL_ERROR "kfac: found Kokkos Kernels but neither Kokkos::kokkoskernels nor trilinos_kokkoskernels")
endif()
