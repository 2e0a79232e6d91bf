#include "elf_loader.hpp"

#include <elf.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>
#include <unordered_map>

namespace tinydev::cpu {

namespace {

struct Elf {
  const unsigned char* data = nullptr;
  std::size_t size = 0;
  const Elf64_Ehdr* header = nullptr;
  std::span<const Elf64_Shdr> sections;
  std::span<const Elf64_Sym> symbols;
  const char* strings = nullptr;  // the symbol string table
  std::size_t strings_size = 0;
  const char* section_names = nullptr;
  std::size_t section_names_size = 0;

  bool in_bounds(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size && length <= size - offset;
  }
  std::string_view symbol_name(const Elf64_Sym& s) const {
    if (s.st_name >= strings_size) return {};
    return std::string_view(strings + s.st_name, ::strnlen(strings + s.st_name, strings_size - s.st_name));
  }
  std::string_view section_name(const Elf64_Shdr& s) const {
    if (!section_names || s.sh_name >= section_names_size) return {};
    return std::string_view(section_names + s.sh_name,
                            ::strnlen(section_names + s.sh_name, section_names_size - s.sh_name));
  }
};

// Parses the header, section table and symbol table with bounds checks; false if malformed.
bool parse(std::span<const std::byte> blob, Elf& elf) {
  elf.data = reinterpret_cast<const unsigned char*>(blob.data());
  elf.size = blob.size();
  if (elf.size < sizeof(Elf64_Ehdr) || std::memcmp(elf.data, ELFMAG, SELFMAG) != 0) return false;
  elf.header = reinterpret_cast<const Elf64_Ehdr*>(elf.data);
  const Elf64_Ehdr& h = *elf.header;
  if (h.e_ident[EI_CLASS] != ELFCLASS64 || h.e_ident[EI_DATA] != ELFDATA2LSB || h.e_type != ET_REL)
    return false;
  if (h.e_shentsize != sizeof(Elf64_Shdr) || h.e_shoff % 8 != 0 ||
      !elf.in_bounds(h.e_shoff, std::uint64_t{h.e_shnum} * sizeof(Elf64_Shdr)))
    return false;
  elf.sections = {reinterpret_cast<const Elf64_Shdr*>(elf.data + h.e_shoff), h.e_shnum};
  if (h.e_shstrndx < h.e_shnum) {
    const Elf64_Shdr& names = elf.sections[h.e_shstrndx];
    if (elf.in_bounds(names.sh_offset, names.sh_size)) {
      elf.section_names = reinterpret_cast<const char*>(elf.data + names.sh_offset);
      elf.section_names_size = names.sh_size;
    }
  }
  for (const Elf64_Shdr& s : elf.sections) {
    if (s.sh_type != SHT_SYMTAB) continue;
    if (s.sh_entsize != sizeof(Elf64_Sym) || s.sh_offset % 8 != 0 || !elf.in_bounds(s.sh_offset, s.sh_size) ||
        s.sh_link >= h.e_shnum)
      return false;
    const Elf64_Shdr& str = elf.sections[s.sh_link];
    if (!elf.in_bounds(str.sh_offset, str.sh_size)) return false;
    elf.symbols = {reinterpret_cast<const Elf64_Sym*>(elf.data + s.sh_offset), s.sh_size / sizeof(Elf64_Sym)};
    elf.strings = reinterpret_cast<const char*>(elf.data + str.sh_offset);
    elf.strings_size = str.sh_size;
  }
  return true;
}

std::size_t align_up(std::size_t v, std::size_t a) { return a <= 1 ? v : (v + a - 1) / a * a; }

// ELF structures are read in place, which needs 8-byte alignment: copy a misaligned blob first.
struct Aligned {
  std::vector<std::uint64_t> storage;
  std::span<const std::byte> bytes;
  explicit Aligned(std::span<const std::byte> blob) : bytes(blob) {
    if (blob.empty() || reinterpret_cast<std::uintptr_t>(blob.data()) % alignof(Elf64_Ehdr) == 0) return;
    storage.resize((blob.size() + 7) / 8);
    std::memcpy(storage.data(), blob.data(), blob.size());
    bytes = std::span<const std::byte>(reinterpret_cast<const std::byte*>(storage.data()), blob.size());
  }
};

bool power_of_two_or_zero(std::uint64_t v) { return (v & (v - 1)) == 0; }

// The bytes a relocation of this kind writes on `machine`, or 0 for a kind the loaders do not know.
std::uint64_t relocation_width(std::uint16_t machine, std::uint32_t type) {
  if (machine == EM_X86_64) {
    switch (type) {
      case R_X86_64_NONE: return 1;  // writes nothing; any offset inside the section
      case R_X86_64_64: case R_X86_64_PC64: case R_X86_64_GOTOFF64: case R_X86_64_GOTPC64:
      case R_X86_64_GOT64: case R_X86_64_GOTPCREL64: case R_X86_64_GOTPLT64: case R_X86_64_PLTOFF64:
      case R_X86_64_SIZE64: case R_X86_64_DTPOFF64: case R_X86_64_TPOFF64: case R_X86_64_DTPMOD64:
        return 8;
      case R_X86_64_PC32: case R_X86_64_PLT32: case R_X86_64_GOT32: case R_X86_64_GOTPCREL:
      case R_X86_64_GOTPCRELX: case R_X86_64_REX_GOTPCRELX: case R_X86_64_32: case R_X86_64_32S:
      case R_X86_64_GOTPC32: case R_X86_64_SIZE32: case R_X86_64_TLSGD: case R_X86_64_TLSLD:
      case R_X86_64_DTPOFF32: case R_X86_64_GOTTPOFF: case R_X86_64_TPOFF32:
      case R_X86_64_GOTPC32_TLSDESC:
        return 4;
      case R_X86_64_16: case R_X86_64_PC16: return 2;
      case R_X86_64_8: case R_X86_64_PC8: return 1;
      case R_X86_64_TLSDESC_CALL: return 1;
      default: return 0;
    }
  }
  if (machine == EM_AARCH64) {
    if (type == R_AARCH64_NONE) return 1;
    if (type == R_AARCH64_ABS64 || type == R_AARCH64_PREL64 || type == 307 /* GOTREL64 */) return 8;
    // Every other static AArch64 relocation patches one 32-bit instruction or word.
    if ((type >= 257 && type <= 313) || (type >= 512 && type <= 573)) return 4;
    return 0;
  }
  return 0;
}

// The section types a compiler puts in a relocatable object for these loaders. Anything else (a
// dynamic section, SHT_SHLIB, an unknown OS type) is not a kernel object.
constexpr std::uint32_t kSHT_LLVM_ADDRSIG = 0x6fff4c03;
bool known_section_type(std::uint32_t type) {
  switch (type) {
    case SHT_NULL: case SHT_PROGBITS: case SHT_SYMTAB: case SHT_STRTAB: case SHT_RELA: case SHT_NOBITS:
    case SHT_NOTE: case SHT_GROUP: case SHT_INIT_ARRAY: case SHT_FINI_ARRAY: case SHT_PREINIT_ARRAY:
    case SHT_X86_64_UNWIND: case kSHT_LLVM_ADDRSIG:
      return true;
    default:
      return false;
  }
}
// Section types whose bytes may be loaded (the others are metadata the loaders read).
bool loadable_section_type(std::uint32_t type) {
  return type == SHT_PROGBITS || type == SHT_NOBITS || type == SHT_NOTE || type == SHT_INIT_ARRAY ||
         type == SHT_FINI_ARRAY || type == SHT_PREINIT_ARRAY || type == SHT_X86_64_UNWIND;
}
constexpr std::uint64_t kSHF_GNU_RETAIN = 0x200000, kSHF_X86_64_LARGE = 0x10000000;
constexpr std::uint64_t kKnownSectionFlags = SHF_WRITE | SHF_ALLOC | SHF_EXECINSTR | SHF_MERGE | SHF_STRINGS |
                                             SHF_INFO_LINK | SHF_LINK_ORDER | SHF_GROUP | SHF_TLS |
                                             kSHF_GNU_RETAIN | kSHF_X86_64_LARGE | SHF_EXCLUDE;

bool string_table_ok(const Elf& elf, const Elf64_Shdr& s) {
  if (s.sh_type != SHT_STRTAB || s.sh_type == SHT_NOBITS || !elf.in_bounds(s.sh_offset, s.sh_size)) return false;
  return s.sh_size == 0 || elf.data[s.sh_offset + s.sh_size - 1] == 0;
}

bool skipped_section(const Elf& elf, const Elf64_Shdr& s) {
  // Unwind tables are only for debuggers and exceptions, which kernels do not throw; loading them
  // would mean registering them with the unwinder.
  return s.sh_type == SHT_X86_64_UNWIND || elf.section_name(s) == ".eh_frame";
}

}  // namespace

std::uint16_t host_elf_machine() noexcept {
#if defined(__x86_64__)
  return EM_X86_64;
#elif defined(__aarch64__)
  return EM_AARCH64;
#else
  return EM_NONE;
#endif
}

std::string check_elf_object(std::span<const std::byte> blob, std::uint16_t machine) {
  Aligned aligned(blob);
  Elf elf;
  elf.data = reinterpret_cast<const unsigned char*>(aligned.bytes.data());
  elf.size = aligned.bytes.size();
  if (elf.size < sizeof(Elf64_Ehdr) || std::memcmp(elf.data, ELFMAG, SELFMAG) != 0)
    return fmt::format("it is not an ELF file ({} bytes, no ELF magic)", elf.size);
  const auto& h = *reinterpret_cast<const Elf64_Ehdr*>(elf.data);
  elf.header = &h;
  if (h.e_ident[EI_CLASS] != ELFCLASS64 || h.e_ident[EI_DATA] != ELFDATA2LSB)
    return "it is not a 64-bit little-endian ELF file";
  if (h.e_type != ET_REL) return fmt::format("it is an ELF file of type {}, not a relocatable object", h.e_type);
  if (h.e_machine != machine)
    return fmt::format("it is an object for ELF machine {}, and this host is machine {}", h.e_machine, machine);
  if (h.e_shentsize != sizeof(Elf64_Shdr) || h.e_shoff % 8 != 0 || h.e_shnum == 0 ||
      !elf.in_bounds(h.e_shoff, std::uint64_t{h.e_shnum} * sizeof(Elf64_Shdr)))
    return "its section header table is malformed or lies outside the file";
  elf.sections = {reinterpret_cast<const Elf64_Shdr*>(elf.data + h.e_shoff), h.e_shnum};
  const std::size_t nsec = elf.sections.size();
  if (h.e_shstrndx == SHN_UNDEF || h.e_shstrndx >= nsec || !string_table_ok(elf, elf.sections[h.e_shstrndx]))
    return "its section name table is missing or malformed";
  std::uint64_t loaded_bytes = 0;
  std::size_t symtab_index = 0;
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& s = elf.sections[i];
    if (i == 0) continue;  // the null section
    if (s.sh_type != SHT_NOBITS && !elf.in_bounds(s.sh_offset, s.sh_size))
      return fmt::format("section {} ({} bytes at offset {}) lies outside the {}-byte file", i, s.sh_size,
                         s.sh_offset, elf.size);
    if (!power_of_two_or_zero(s.sh_addralign) || s.sh_addralign > 4096)
      return fmt::format("section {} asks for an alignment of {} (a power of two up to 4096 is expected)", i,
                         s.sh_addralign);
    if (s.sh_name >= elf.sections[h.e_shstrndx].sh_size) return fmt::format("section {}'s name lies outside the name table", i);
    if (!known_section_type(s.sh_type)) return fmt::format("section {} has type {:#x}, which no kernel object has", i, s.sh_type);
    if (s.sh_flags & ~kKnownSectionFlags)
      return fmt::format("section {} has flags {:#x}, beyond those a kernel object uses (compressed, OS-specific)", i,
                         s.sh_flags);
    if ((s.sh_flags & SHF_ALLOC) && !loadable_section_type(s.sh_type))
      return fmt::format("section {} of type {:#x} is marked to be loaded", i, s.sh_type);
    // Unwind tables are left out of what ORC sees (Note [No unwind tables for ORC]): one that is
    // code or data in disguise would take its symbols with it, and JITLink crashes on a symbol
    // whose section is gone (LLVM 19; found by the mutated-objects test: .text retyped as
    // SHT_X86_64_UNWIND).
    if (skipped_section(elf, s) && (s.sh_flags & (SHF_EXECINSTR | SHF_WRITE | SHF_TLS)))
      return fmt::format("unwind section {} is marked executable, writable or thread-local", i);
    if ((s.sh_type == SHT_INIT_ARRAY || s.sh_type == SHT_FINI_ARRAY || s.sh_type == SHT_PREINIT_ARRAY) &&
        s.sh_size % 8 != 0)
      return fmt::format("initializer section {} is not a whole number of pointers", i);
    if (s.sh_flags & SHF_ALLOC) {
      if (s.sh_size > kMaxLoadedObjectBytes || (loaded_bytes += s.sh_size + s.sh_addralign) > kMaxLoadedObjectBytes)
        return fmt::format("its loaded sections take more than {} bytes", kMaxLoadedObjectBytes);
    }
    switch (s.sh_type) {
      case SHT_SYMTAB:
        if (symtab_index) return "it has more than one symbol table";
        symtab_index = i;
        break;
      case SHT_STRTAB:
        if (!string_table_ok(elf, s)) return fmt::format("string table {} is not NUL-terminated", i);
        break;
      case SHT_REL:
        return "it has REL relocations (this machine's objects use RELA)";
      case SHT_SYMTAB_SHNDX:
        return "it uses extended section indices (more than 65,280 sections)";
      case SHT_GROUP: {
        if (s.sh_size % 4 != 0 || s.sh_size < 4 || s.sh_offset % 4 != 0) return fmt::format("group section {} is malformed", i);
        for (std::uint64_t at = 4; at < s.sh_size; at += 4) {
          std::uint32_t member;
          std::memcpy(&member, elf.data + s.sh_offset + at, 4);
          if (member == 0 || member >= nsec) return fmt::format("group section {} names section {}, which does not exist", i, member);
        }
        break;
      }
      default:
        break;
    }
  }
  if (!symtab_index) return "it has no symbol table";
  const Elf64_Shdr& st = elf.sections[symtab_index];
  if (st.sh_entsize != sizeof(Elf64_Sym) || st.sh_size % sizeof(Elf64_Sym) != 0 || st.sh_offset % 8 != 0 ||
      st.sh_link == 0 || st.sh_link >= nsec || !string_table_ok(elf, elf.sections[st.sh_link]))
    return "its symbol table is malformed (entry size, size, alignment or string table)";
  const std::uint64_t nsyms = st.sh_size / sizeof(Elf64_Sym);
  if (st.sh_info > nsyms) return "its symbol table's first global symbol lies past its end";
  elf.symbols = {reinterpret_cast<const Elf64_Sym*>(elf.data + st.sh_offset), nsyms};
  const std::uint64_t strings_size = elf.sections[st.sh_link].sh_size;
  for (std::uint64_t i = 0; i < nsyms; ++i) {
    const Elf64_Sym& sym = elf.symbols[i];
    if (sym.st_name >= strings_size && !(sym.st_name == 0 && strings_size == 0))
      return fmt::format("symbol {}'s name lies outside the string table", i);
    const unsigned type = ELF64_ST_TYPE(sym.st_info), bind = ELF64_ST_BIND(sym.st_info);
    if (type > STT_TLS) return fmt::format("symbol {} has type {}, which a kernel object does not use", i, type);
    if (bind != STB_LOCAL && bind != STB_GLOBAL && bind != STB_WEAK)
      return fmt::format("symbol {} has binding {}, which a kernel object does not use", i, bind);
    if ((i < st.sh_info) != (bind == STB_LOCAL) && i != 0)
      return fmt::format("symbol {} is {} but lies in the {} part of the symbol table", i,
                         bind == STB_LOCAL ? "local" : "global", i < st.sh_info ? "local" : "global");
    const std::uint16_t shndx = sym.st_shndx;
    if (shndx == SHN_UNDEF || shndx == SHN_ABS || shndx == SHN_COMMON) {
      if (shndx == SHN_COMMON && (sym.st_size > kMaxLoadedObjectBytes || !power_of_two_or_zero(sym.st_value) ||
                                  sym.st_value > 4096))
        return fmt::format("common symbol {} has a size or alignment out of range", i);
      continue;
    }
    if (shndx >= nsec) return fmt::format("symbol {} names section {}, which does not exist", i, shndx);
    const Elf64_Shdr& in = elf.sections[shndx];
    if (skipped_section(elf, in) && type != STT_SECTION)
      return fmt::format("symbol {} is defined in unwind section {}, which is not loaded", i, shndx);
    if ((type == STT_FUNC || type == STT_OBJECT || type == STT_TLS) && !(in.sh_flags & SHF_ALLOC))
      return fmt::format("symbol {} is code or data in section {}, which is not loaded", i, shndx);
    if (type == STT_FUNC && !(in.sh_flags & SHF_EXECINSTR))
      return fmt::format("function symbol {} lies in section {}, which is not code", i, shndx);
    if ((type == STT_TLS) != ((in.sh_flags & SHF_TLS) != 0) && type != STT_SECTION && type != STT_NOTYPE)
      return fmt::format("symbol {} and its section {} disagree about thread-local storage", i, shndx);
    if ((in.sh_flags & SHF_ALLOC) &&
        (sym.st_value > in.sh_size || sym.st_size > in.sh_size - sym.st_value))
      return fmt::format("symbol {} ({} bytes at {}) lies outside its {}-byte section", i, sym.st_size,
                         sym.st_value, in.sh_size);
  }
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& r = elf.sections[i];
    if (r.sh_type != SHT_RELA) continue;
    if (r.sh_entsize != sizeof(Elf64_Rela) || r.sh_size % sizeof(Elf64_Rela) != 0 || r.sh_offset % 8 != 0)
      return fmt::format("relocation section {} is malformed (entry size, size or alignment)", i);
    if (r.sh_link != symtab_index) return fmt::format("relocation section {} does not use the symbol table", i);
    if (r.sh_info == 0 || r.sh_info >= nsec) return fmt::format("relocation section {} applies to no section", i);
    if (r.sh_flags & SHF_ALLOC) return fmt::format("relocation section {} is marked to be loaded", i);
    const Elf64_Shdr& target = elf.sections[r.sh_info];
    if (target.sh_type == SHT_NOBITS) return fmt::format("relocation section {} patches a section with no bytes", i);
    for (const Elf64_Rela& rel : std::span<const Elf64_Rela>(
             reinterpret_cast<const Elf64_Rela*>(elf.data + r.sh_offset), r.sh_size / sizeof(Elf64_Rela))) {
      const std::uint64_t sym = ELF64_R_SYM(rel.r_info);
      const std::uint32_t type = ELF64_R_TYPE(rel.r_info);
      if (sym >= nsyms) return fmt::format("a relocation in section {} names symbol {} of {}", i, sym, nsyms);
      // The null symbol: no compiler emits a kernel relocation against it, and JITLink crashes
      // formatting its error for one (LLVM 19; found by fuzz_loader).
      if (sym == 0) return fmt::format("a relocation in section {} names the null symbol (index 0)", i);
      // Only unwind tables may point into unwind tables: they are not loaded.
      const std::uint16_t sym_section = elf.symbols[sym].st_shndx;
      if (sym_section != SHN_UNDEF && sym_section < nsec && skipped_section(elf, elf.sections[sym_section]) &&
          !skipped_section(elf, target))
        return fmt::format("a relocation in section {} points into unwind section {}, which is not loaded", i, sym_section);
      const std::uint64_t width = relocation_width(machine, type);
      if (width == 0) return fmt::format("a relocation in section {} has kind {}, which this machine does not define", i, type);
      if (rel.r_offset > target.sh_size || width > target.sh_size - rel.r_offset)
        return fmt::format("a relocation at offset {} lies outside its {}-byte section", rel.r_offset, target.sh_size);
    }
  }
  return {};
}

// Note [No unwind tables for ORC]
// JITLink parses an object's .eh_frame (even a section not marked SHF_ALLOC) and hands it to
// libgcc's __register_frame, which walks CIEs and FDEs with no bounds checks of its own: damaged
// unwind tables that pass every structural check crashed the process inside JITLink's parser or,
// later, inside the unwinder. Kernels never throw and the fast loader never loaded unwind tables
// either, so the copy given to ORC has each unwind section, and each relocation section patching
// one, turned into SHT_NULL, which JITLink skips.
std::vector<std::byte> without_unwind_tables(std::span<const std::byte> checked_object) {
  std::vector<std::byte> out(checked_object.begin(), checked_object.end());
  if (out.size() < sizeof(Elf64_Ehdr)) return out;
  Elf64_Ehdr h;
  std::memcpy(&h, out.data(), sizeof h);
  Elf elf;
  elf.data = reinterpret_cast<const unsigned char*>(out.data());
  elf.size = out.size();
  if (!elf.in_bounds(h.e_shoff, std::uint64_t{h.e_shnum} * sizeof(Elf64_Shdr)) || h.e_shstrndx >= h.e_shnum) return out;
  auto header = [&](std::size_t i) {
    Elf64_Shdr s;
    std::memcpy(&s, out.data() + h.e_shoff + i * sizeof(Elf64_Shdr), sizeof s);
    return s;
  };
  auto set_null = [&](std::size_t i) {
    const std::uint32_t null_type = SHT_NULL;
    std::memcpy(out.data() + h.e_shoff + i * sizeof(Elf64_Shdr) + offsetof(Elf64_Shdr, sh_type), &null_type, 4);
  };
  const Elf64_Shdr names = header(h.e_shstrndx);
  if (!elf.in_bounds(names.sh_offset, names.sh_size)) return out;
  std::vector<bool> unwind(h.e_shnum, false);
  for (std::size_t i = 0; i < h.e_shnum; ++i) {
    const Elf64_Shdr s = header(i);
    const char* name = reinterpret_cast<const char*>(elf.data + names.sh_offset + s.sh_name);
    unwind[i] = s.sh_type == SHT_X86_64_UNWIND ||
                (s.sh_name < names.sh_size &&
                 std::string_view(name, ::strnlen(name, names.sh_size - s.sh_name)) == ".eh_frame");
  }
  for (std::size_t i = 0; i < h.e_shnum; ++i) {
    const Elf64_Shdr s = header(i);
    if (unwind[i] || ((s.sh_type == SHT_RELA || s.sh_type == SHT_REL) && s.sh_info < h.e_shnum && unwind[s.sh_info]))
      set_null(i);
  }
  return out;
}

LoadedObject::~LoadedObject() {
  if (base_) ::munmap(base_, size_);
}

std::optional<std::vector<std::string>> elf_functions(std::span<const std::byte> blob) {
  Aligned aligned(blob);
  Elf elf;
  if (!parse(aligned.bytes, elf)) return std::nullopt;
  std::vector<std::string> out;
  for (const Elf64_Sym& s : elf.symbols)
    if (ELF64_ST_TYPE(s.st_info) == STT_FUNC && ELF64_ST_BIND(s.st_info) != STB_LOCAL && s.st_shndx != SHN_UNDEF)
      out.emplace_back(elf.symbol_name(s));
  return out;
}

ElfLoadResult load_elf_x86_64(std::span<const std::byte> blob, std::string_view function,
                              const SymbolResolver& resolve) {
  ElfLoadResult result;
  auto decline = [&](std::string why) {
    result.declined = std::move(why);
    return std::move(result);
  };
  // Defensive checks below that a validated object cannot fail are errors, not declines: ORC must
  // never see a malformed object (Note [Object validation]).
  auto malformed = [&](std::string why) {
    result.error = "malformed object: " + std::move(why);
    return std::move(result);
  };
  if (std::string why = check_elf_object(blob, EM_X86_64); !why.empty()) return malformed(std::move(why));
  Aligned aligned(blob);
  Elf elf;
  if (!parse(aligned.bytes, elf)) return malformed("not an ELF64 little-endian relocatable object");
  const std::size_t nsec = elf.sections.size();

  // 1. Which sections load.
  std::vector<bool> loaded(nsec, false);
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& s = elf.sections[i];
    if (!(s.sh_flags & SHF_ALLOC) || s.sh_size == 0 || skipped_section(elf, s)) continue;
    const std::string_view name = elf.section_name(s);
    if (name.starts_with(".init_array") || name.starts_with(".fini_array") || name.starts_with(".ctors") ||
        (s.sh_flags & SHF_TLS))
      return decline(fmt::format("section {} needs initializers or TLS", name));
    if (s.sh_type != SHT_NOBITS && !elf.in_bounds(s.sh_offset, s.sh_size))
      return malformed("section out of bounds");
    loaded[i] = true;
  }

  // 2. Which symbols need a GOT slot or a call stub.
  std::unordered_map<std::uint32_t, std::size_t> got_slot, stub_slot;
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& r = elf.sections[i];
    if (r.sh_type == SHT_REL) return malformed("REL relocations (x86-64 objects use RELA)");
    if (r.sh_type != SHT_RELA || r.sh_info >= nsec || !loaded[r.sh_info]) continue;
    if (r.sh_entsize != sizeof(Elf64_Rela) || r.sh_offset % 8 != 0 || !elf.in_bounds(r.sh_offset, r.sh_size))
      return malformed("malformed relocation section");
    for (const Elf64_Rela& rel : std::span<const Elf64_Rela>(
             reinterpret_cast<const Elf64_Rela*>(elf.data + r.sh_offset), r.sh_size / sizeof(Elf64_Rela))) {
      const std::uint32_t sym = ELF64_R_SYM(rel.r_info), type = ELF64_R_TYPE(rel.r_info);
      if (sym >= elf.symbols.size()) return malformed("relocation symbol out of range");
      if (type == R_X86_64_GOTPCREL || type == R_X86_64_GOTPCRELX || type == R_X86_64_REX_GOTPCRELX)
        got_slot.emplace(sym, got_slot.size());
      if (type == R_X86_64_PLT32 && elf.symbols[sym].st_shndx == SHN_UNDEF) {
        stub_slot.emplace(sym, stub_slot.size());
        got_slot.emplace(sym, got_slot.size());  // the stub jumps through the GOT
      }
    }
  }

  // 3. Layout: code, then the call stubs (reachable from the code with rel32), then from the next
  // page boundary the data sections and the GOT, so code and data never share a page.
  constexpr std::size_t kStub = 8;  // jmp *disp32(%rip) (6 bytes) + 2 bytes of int3
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::size_t> place(nsec, 0);
  std::size_t code_cursor = 0;
  for (std::size_t i = 0; i < nsec; ++i) {
    if (!loaded[i] || !(elf.sections[i].sh_flags & SHF_EXECINSTR)) continue;
    code_cursor = align_up(code_cursor, elf.sections[i].sh_addralign);
    place[i] = code_cursor;
    code_cursor += elf.sections[i].sh_size;
  }
  const std::size_t stubs_at = align_up(code_cursor, 16);
  const std::size_t data_at = align_up(stubs_at + stub_slot.size() * kStub, page);
  std::size_t data_cursor = data_at;
  for (std::size_t i = 0; i < nsec; ++i) {
    if (!loaded[i] || (elf.sections[i].sh_flags & SHF_EXECINSTR)) continue;
    data_cursor = align_up(data_cursor, elf.sections[i].sh_addralign);
    place[i] = data_cursor;
    data_cursor += elf.sections[i].sh_size;
  }
  const std::size_t got_at = align_up(data_cursor, 8);
  const std::size_t total = align_up(got_at + got_slot.size() * 8, page);

  void* mem = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return decline("mmap failed");
  auto object = std::make_unique<LoadedObject>(mem, total);
  auto* base = static_cast<unsigned char*>(mem);
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& s = elf.sections[i];
    if (!loaded[i]) continue;
    if (s.sh_type == SHT_NOBITS) continue;  // the mapping is zero-filled already
    std::memcpy(base + place[i], elf.data + s.sh_offset, s.sh_size);
  }

  // 4. Symbol addresses, the GOT and the stubs.
  auto symbol_address = [&](std::uint32_t index, std::uint64_t& out) -> bool {
    const Elf64_Sym& s = elf.symbols[index];
    if (s.st_shndx == SHN_UNDEF) {
      std::string_view name = elf.symbol_name(s);
      void* p = resolve(name);
      if (!p && ELF64_ST_BIND(s.st_info) != STB_WEAK) {
        result.error += fmt::format("{}Symbols not found: [ {} ]", result.error.empty() ? "" : "; ", name);
        return false;
      }
      out = reinterpret_cast<std::uintptr_t>(p);
      return true;
    }
    if (s.st_shndx == SHN_ABS) {
      out = s.st_value;
      return true;
    }
    if (s.st_shndx < nsec && loaded[s.st_shndx] && s.st_value > elf.sections[s.st_shndx].sh_size) {
      result.error = "malformed object: a symbol lies outside its section";
      return false;
    }
    if (s.st_shndx == SHN_COMMON) {
      result.declined = "common symbols";
      return false;
    }
    if (s.st_shndx >= nsec || !loaded[s.st_shndx]) {
      result.declined = "a symbol in a section that is not loaded";
      return false;
    }
    out = reinterpret_cast<std::uintptr_t>(base + place[s.st_shndx]) + s.st_value;
    return true;
  };
  for (auto [sym, slot] : got_slot) {
    std::uint64_t addr = 0;
    if (!symbol_address(sym, addr)) continue;
    std::memcpy(base + got_at + slot * 8, &addr, 8);
  }
  for (auto [sym, slot] : stub_slot) {
    unsigned char* stub = base + stubs_at + slot * kStub;
    const std::int64_t disp = static_cast<std::int64_t>(got_at + got_slot.at(sym) * 8) -
                              static_cast<std::int64_t>(stubs_at + slot * kStub + 6);  // both < 2^40
    const std::int32_t d32 = static_cast<std::int32_t>(disp);
    stub[0] = 0xff;
    stub[1] = 0x25;
    std::memcpy(stub + 2, &d32, 4);
    stub[6] = stub[7] = 0xcc;
  }
  if (!result.error.empty()) {
    result.declined.clear();
    return result;
  }
  if (!result.declined.empty()) return result;

  // 5. Relocations.
  for (std::size_t i = 0; i < nsec; ++i) {
    const Elf64_Shdr& r = elf.sections[i];
    if (r.sh_type != SHT_RELA || r.sh_info >= nsec || !loaded[r.sh_info]) continue;
    const Elf64_Shdr& target = elf.sections[r.sh_info];
    for (const Elf64_Rela& rel : std::span<const Elf64_Rela>(
             reinterpret_cast<const Elf64_Rela*>(elf.data + r.sh_offset), r.sh_size / sizeof(Elf64_Rela))) {
      const std::uint32_t sym = ELF64_R_SYM(rel.r_info), type = ELF64_R_TYPE(rel.r_info);
      if (rel.r_offset > target.sh_size || target.sh_size - rel.r_offset < relocation_width(EM_X86_64, type))
        return malformed("relocation outside its section");
      unsigned char* where = base + place[r.sh_info] + rel.r_offset;
      const std::int64_t P = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(where));
      const std::int64_t A = rel.r_addend;
      std::uint64_t S = 0;
      auto write32 = [&](std::int64_t v) -> bool {
        if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
          return false;
        const std::int32_t v32 = static_cast<std::int32_t>(v);
        std::memcpy(where, &v32, 4);
        return true;
      };
      // Relocation arithmetic is modulo 2^64 (a hostile addend must not be signed overflow).
      auto sum = [](std::uint64_t s, std::int64_t a, std::int64_t p) {
        return static_cast<std::int64_t>(s + static_cast<std::uint64_t>(a) - static_cast<std::uint64_t>(p));
      };
      switch (type) {
        case R_X86_64_NONE:
          break;
        case R_X86_64_64: {
          if (target.sh_size - rel.r_offset < 8) return malformed("relocation outside its section");
          if (!symbol_address(sym, S)) return result;
          const std::uint64_t v = S + static_cast<std::uint64_t>(A);
          std::memcpy(where, &v, 8);
          break;
        }
        case R_X86_64_PC64: {
          if (target.sh_size - rel.r_offset < 8) return malformed("relocation outside its section");
          if (!symbol_address(sym, S)) return result;
          const std::int64_t v = sum(S, A, P);
          std::memcpy(where, &v, 8);
          break;
        }
        case R_X86_64_PC32:
        case R_X86_64_PLT32: {
          if (auto stub = stub_slot.find(sym); stub != stub_slot.end())
            S = reinterpret_cast<std::uintptr_t>(base + stubs_at + stub->second * kStub);
          else if (!symbol_address(sym, S))
            return result;
          if (!write32(sum(S, A, P)))
            return decline(fmt::format("a 32-bit PC-relative reference to '{}' is out of range",
                                       elf.symbol_name(elf.symbols[sym])));
          break;
        }
        case R_X86_64_GOTPCREL:
        case R_X86_64_GOTPCRELX:
        case R_X86_64_REX_GOTPCRELX: {
          const std::int64_t G =
              static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(base + got_at + got_slot.at(sym) * 8));
          if (!write32(sum(static_cast<std::uint64_t>(G), A, P))) return decline("GOT out of range");
          break;
        }
        case R_X86_64_32:
        case R_X86_64_32S: {
          if (!symbol_address(sym, S)) return result;
          const std::int64_t v = sum(S, A, 0);
          if (type == R_X86_64_32 ? (v < 0 || v > 0xffffffffll) : !write32(v))
            return decline("a 32-bit absolute reference out of range (object not built -fPIC)");
          if (type == R_X86_64_32) {
            const std::uint32_t v32 = static_cast<std::uint32_t>(v);
            std::memcpy(where, &v32, 4);
          }
          break;
        }
        default:
          return decline(fmt::format("relocation type {} is not handled by the fast loader", type));
      }
    }
  }

  // 6. Seal: code read+execute, the rest stays read+write.
  if (data_at > 0 && ::mprotect(base, data_at, PROT_READ | PROT_EXEC) != 0) return decline("mprotect failed");
  for (const Elf64_Sym& s : elf.symbols) {
    if (ELF64_ST_TYPE(s.st_info) != STT_FUNC || s.st_shndx == SHN_UNDEF || s.st_shndx >= nsec ||
        !loaded[s.st_shndx] || elf.symbol_name(s) != function)
      continue;
    if (s.st_value >= elf.sections[s.st_shndx].sh_size) return malformed("the function's address lies outside its section");
    object->entry = base + place[s.st_shndx] + s.st_value;
  }
  if (!object->entry) return decline(fmt::format("function '{}' not found", function));
  result.object = std::move(object);
  return result;
}

}  // namespace tinydev::cpu
