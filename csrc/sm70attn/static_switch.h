// The one dispatch level: runtime parameters -> template parameters, through the instances the
// registration list (registry.h) gives each family: family_switch<F>({params}, f) calls f with the
// traits of family F's listed instance of those parameters. Host code only (the launcher, the
// binding, the CPU emulator); NVRTC compiles each kernel alone.
#pragma once

#include "sm70attn/registry.h"
#include "sm70attn/traits.h"

#ifndef __CUDACC_RTC__
#include <initializer_list>

namespace sm70attn {

inline bool same_params(std::initializer_list<int> a, std::initializer_list<int> b) {
  if (a.size() != b.size()) return false;
  for (auto i = a.begin(), j = b.begin(); i != a.end(); ++i, ++j)
    if (*i != *j) return false;
  return true;
}

// Instances<F>::find(params, f): f(traits{}) for family F's instance with these parameters, false
// when none is listed. One specialization a family, from its registry entry: its traits
// template instantiated with each X(...) of its instance list.
template <int F>
struct Instances;
#define SM70ATTN_FIND(...) \
  if (same_params(k, {__VA_ARGS__})) return f(Traits<__VA_ARGS__>{}), true;
#define SM70ATTN_INSTANCES(ID, family, kind, header, kernel, TRAITS, name, INSTANCES) \
  template <>                                                                          \
  struct Instances<ID> {                                                               \
    template <int... P>                                                                \
    using Traits = TRAITS<P...>;                                                       \
    template <class F>                                                                 \
    static bool find(std::initializer_list<int> k, F&& f) {                            \
      INSTANCES(SM70ATTN_FIND)                                                         \
      return false;                                                                    \
    }                                                                                  \
  };
SM70ATTN_FAMILIES(SM70ATTN_INSTANCES)
#undef SM70ATTN_INSTANCES
#undef SM70ATTN_FIND

template <int FAMILY, class F>
inline bool family_switch(std::initializer_list<int> params, F&& f) {
  return Instances<FAMILY>::find(params, f);
}

// The switches the launcher takes, by the values a call has.

// f(AttnTraits<D, MB, VEC>{}) for the listed WMMA kernel.
template <class F>
inline bool attn_switch(int d, int mb, int vec, F&& f) {
  return family_switch<ATTN_WMMA>({d, mb, vec}, f);
}

// f(AttnRfTraits<D, MB, VEC>{}) for the listed register-fragment kernel (both atoms' families
// list the same instances).
template <class F>
inline bool attn_rf_switch(int d, int mb, int vec, F&& f) {
  return family_switch<ATTN_RF_M8N8K4>({d, mb, vec}, f);
}

// f(CombineTraits<D, combine_warps_per_row(splits)>{}) for the listed combine kernel.
template <class F>
inline bool combine_switch(int d, int splits, F&& f) {
  return family_switch<COMBINE>({d, combine_warps_per_row(splits)}, f);
}

// f(AttnTraits<D, MB, VEC>{}) for the listed varlen tile loop.
template <class F>
inline bool varlen_switch(int d, int mb, int vec, F&& f) {
  return family_switch<ATTN_VARLEN>({d, mb, vec}, f);
}

// f(CombineVarlenTraits<D>{}) for the listed combine of split requests.
template <class F>
inline bool combine_varlen_switch(int d, F&& f) {
  return family_switch<COMBINE_VARLEN>({d}, f);
}

// f(PrefillTraits<D, VEC>{}) for the listed prefill kernel (both atoms' families list the same
// instances).
template <class F>
inline bool prefill_switch(int d, int vec, F&& f) {
  return family_switch<PREFILL_M8N8K4>({d, vec}, f);
}

}  // namespace sm70attn
#endif  // __CUDACC_RTC__
